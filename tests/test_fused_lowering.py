"""CPU: the fused o_proj tail kernel (producer + AttnRes consumer in one persistent launch)
compiles for sm_90a at every TP, in virtual TP and per mesh rank, and the tail takes the
table's variant."""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3 import tuning
from jax_kimik3.config import KIMI_K3
from jax_kimik3.layout import MailboxLayout, MailboxSpec
from tests.lowering import CUSTOM_CALL, kept_ptx, kernel_calls, spec

pytest.importorskip("cutlass")
from jax_kimik3.kernels import fused, oproj, residency  # noqa: E402

H, K_TOTAL, NB = KIMI_K3.hidden_size, KIMI_K3.o_proj_in_features, KIMI_K3.num_attn_res_blocks
EPS = KIMI_K3.rms_norm_eps


def tail(ranks, tp, b, *, num_blocks=4, has_delta=True, out_norm=True, variant=None,
         two_shot=None):
    """(kernel calls, StableHLO) of `ranks` ranks' tails (R = 1: one mesh rank; R = TP:
    virtual TP) at (TP, B)."""
    def f(x, w, prefix, blocks, g, proj, out_w, table, ids):
        return oproj.tail(x, w, prefix, blocks, g, proj, out_w if out_norm else None,
                          table=table, ranks=ids, spec=MailboxSpec(MailboxLayout(tp)),
                          num_blocks=num_blocks, has_delta=has_delta, eps=1e-5, out_eps=1e-5,
                          variant=variant, two_shot=two_shot)
    k = K_TOTAL // tp
    return kernel_calls(f, spec(ranks, b, k), spec(ranks, H, k), spec(b, H), spec(b, NB, H),
                        spec(H), spec(H), spec(H), spec(tp + 1, 2, dtype=jnp.uint32),
                        spec(ranks, dtype=jnp.int32))


@pytest.mark.parametrize("b", [1, 2, 5, 8, 9, 16, 64])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_fused_virtual_is_one_launch(tp, b):
    """All TP ranks' producers and consumers in one custom call on a grid of co-resident
    clusters (separate launches on one stream would deadlock: rank r's consumer waits on rank
    r+1's producer)."""
    calls, text = tail(tp, tp, b, variant="fused")
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1
    assert "dot_general" not in text
    (call,) = calls
    assert call.variant.family == "fused"
    assert call.variant.params[-1] == residency.FALLBACK_CLUSTERS  # no GPU here


@pytest.mark.parametrize("num_blocks,has_delta,out_norm", [(1, False, True), (1, True, True),
                                                           (4, True, False), (8, True, True),
                                                           (0, False, True)])
def test_fused_call_sites_lower(num_blocks, has_delta, out_norm):
    """Write layers (a new block, no delta), delta layers, K = 0..8, with and without norm."""
    assert CUSTOM_CALL in tail(8, 8, 8, num_blocks=num_blocks, has_delta=has_delta,
                               out_norm=out_norm, variant="fused")[1]


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_fused_mesh_rank_is_one_launch(tp):
    _, text = tail(1, tp, 8, variant="fused")
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1


def test_fused_grid_is_every_co_resident_cluster_it_needs():
    """The persistent grid: min(co-resident clusters, the work's clusters)."""
    from jax_kimik3.kernels.variants import AttnResVariant, Reduction
    variant = AttnResVariant(num_blocks=4, has_delta=True, write_idx=-1, out_norm=True, precomputed=False, eps=EPS, out_eps=EPS,
                             reduction=Reduction(MailboxSpec(MailboxLayout(8)), ranks=1))
    assert fused.OprojAttnResFused(4, 1536, variant, 1000).clusters == 448 // 7 + 4
    assert fused.OprojAttnResFused(4, 1536, variant, 60).clusters == 60
    many = AttnResVariant(num_blocks=4, has_delta=True, write_idx=-1, out_norm=True, precomputed=False, eps=EPS, out_eps=EPS,
                          reduction=Reduction(MailboxSpec(MailboxLayout(8)), ranks=8))
    assert fused.OprojAttnResFused(4, 1536, many, residency.FALLBACK_CLUSTERS).clusters == 69


@pytest.mark.parametrize("b,tp", [(1, 8), (8, 16), (16, 8), (64, 8), (8, 1), (1, 2), (12, 2),
                                  (20, 2), (20, 4), (32, 16)])
def test_tail_takes_the_table_variant(b, tp):
    """tuning.tail_variant decides: split (the tail call with the producer kernel, compiled
    for B tiles and K), xla (XLA's dot, then the tail call for any B), fused where it is named
    (one persistent kernel); one custom call in every case, the two-shot owner inside it where
    the table says so."""
    variant = tuning.tail_variant(b, K_TOTAL // tp)
    calls, text = tail(1, tp, b)
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1
    (call,) = calls
    family, params = call.variant.family, call.variant.params
    assert family == ("fused" if variant == "fused" else "tail")
    if family == "tail":
        assert params[:2] == (((b + 7) // 8, K_TOTAL // tp) if variant == "split"
                              else (None, None))
        assert params[2].reduction.two_shot == tuning.use_two_shot(b, tp)
    assert ("dot_general" in text) == (variant == "xla")


def test_table_is_one_table_of_known_variants():
    """Each K's entries rise in B and name known variants; tail_variant gives an entry's
    variant up to its bound and the next one's after it, XLA's dot past the last and at a K
    the table does not list."""
    for k, entries in tuning.TAIL_VARIANTS.items():
        bounds = [b for b, _ in entries]
        assert bounds == sorted(bounds), k
        assert all(v in tuning.TAIL_VARIANT_NAMES for _, v in entries)
        nexts = [v for _, v in entries[1:]] + ["xla"]
        for (bound, variant), after in zip(entries, nexts):
            assert tuning.tail_variant(bound, k) == variant
            assert tuning.tail_variant(bound + 1, k) == after
    assert tuning.tail_variant(1, 12288) == "xla"
    for tp, first in tuning.TWO_SHOT_BATCHES.items():
        assert tuning.use_two_shot(first, tp) and not tuning.use_two_shot(first - 1, tp)
    assert not tuning.use_two_shot(64, 2)


@pytest.mark.parametrize("variant, tp, b", [("fused", 2, 12), ("xla", 2, 12), ("fused", 8, 32)])
def test_public_variant_overrides_the_table(variant, tp, b):
    """oproj_attn_res(variant=...) under shard_map launches that variant at a (TP, B) whose
    table entry is another (TP 2, B = 12: split; TP 8, B = 32: split, two-shot); the fused
    tail one-shot wherever the table says two-shot."""
    assert tuning.tail_variant(b, K_TOTAL // tp) != variant

    def rank(*args):
        return k3.oproj_attn_res(*args[:-1], peer_table=args[-1], axis_name="tp", num_blocks=3,
                                 has_delta=True, mailbox=MailboxSpec(MailboxLayout(tp)),
                                 variant=variant, backend="kernel")

    f = jax.shard_map(rank, mesh=Mesh(np.array(jax.devices()[:tp]), ("tp",)),
                      in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 6, out_specs=P())
    calls, text = kernel_calls(f, spec(b, K_TOTAL), spec(H, K_TOTAL), spec(b, H),
                               spec(b, NB, H), spec(H), spec(H), spec(H),
                               spec(tp + 1, 2, dtype=jnp.uint32))
    (call,) = calls
    assert call.variant.family == ("fused" if variant == "fused" else "tail")
    assert call.variant.params[2].reduction.two_shot == (
        variant != "fused" and tuning.use_two_shot(b, tp))
    assert ("dot_general" in text) == (variant == "xla")


@pytest.mark.parametrize("variant, two_shot", [(None, None), ("xla", False), ("split", False)])
def test_decode_step_carries_the_tails_overrides(variant, two_shot):
    """decode.make_step(two_shot=, variant=) reaches every layer's post-attention tail
    (AttentionTail): at TP 8, B = 32 the table's split two-shot tail, else the asked one."""
    from jax_kimik3 import backend, decode
    from jax_kimik3.kernels import launch
    from jax.sharding import AbstractMesh

    tp, b, layers = 8, 32, 2
    assert tuning.tail_variant(b, K_TOTAL // tp) == "split" and tuning.use_two_shot(b, tp)
    params = decode.param_shapes(layers)
    step = decode.make_step(AbstractMesh((tp,), ("tp",)), params, layers, "kernel",
                            MailboxSpec(MailboxLayout(tp)), two_shot=two_shot, variant=variant)
    calls = []
    with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: calls.append(c)):
        step.trace(params, spec(b, H), spec(b, NB, H), spec(tp, tp + 1, 2, dtype=jnp.uint32))
    tails = [c for c in calls if c.variant.family == "tail"]
    assert len(tails) == layers
    for call in tails:
        assert (call.variant.params[0] is None) == (variant == "xla")
        assert call.variant.params[2].reduction.two_shot == (two_shot is not False)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match=r"variant='two_shot' must be one of"):
        tail(1, 8, 8, variant="two_shot")


def test_fused_refuses_what_it_does_not_do():
    from jax_kimik3.kernels.variants import AttnResVariant, Reduction
    one_shot = Reduction(MailboxSpec(MailboxLayout(8)))
    consumer = AttnResVariant(num_blocks=4, has_delta=True, write_idx=-1, out_norm=True, precomputed=False, eps=EPS, out_eps=EPS, reduction=one_shot)
    with pytest.raises(ValueError, match="must complete a one-shot reduction"):
        fused.OprojAttnResFused(8, 1536, AttnResVariant(num_blocks=4, has_delta=True, write_idx=-1, out_norm=True, precomputed=False, eps=EPS, out_eps=EPS), 60)
    with pytest.raises(ValueError, match="must complete a one-shot reduction"):
        fused.OprojAttnResFused(8, 1536, AttnResVariant(
            num_blocks=4, has_delta=True, write_idx=-1, out_norm=True, precomputed=False, eps=EPS, out_eps=EPS, reduction=Reduction(one_shot.spec, 1, True)), 60)
    with pytest.raises(ValueError, match="o_proj producer"):
        fused.OprojAttnResFused(65, 1536, consumer, 60)
    with pytest.raises(ValueError, match="clusters=0 must be >= 1"):
        fused.OprojAttnResFused(8, 1536, consumer, 0)


def test_fused_ptx(tmp_path):
    """One sm_90a kernel of 256 threads with the producer's bf16 mma.sync and streamed weight
    loads, the strong publish stores into every rank's mailbox after a system fence, the
    consumer's strong polling loads, the cluster barriers and DSMEM stores of AttnRes; at most
    64 registers (4 CTAs per SM: .minnctapersm) and, by ptxas where installed, no more than a
    few words spilled."""
    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp
        from jax_kimik3.kernels import oproj
        from jax_kimik3.layout import MailboxLayout, MailboxSpec
        s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
        f = lambda x, w, p, bl, g, pw, o, t, r: oproj.tail(
            x, w, p, bl, g, pw, o, table=t, ranks=r, spec=MailboxSpec(MailboxLayout(4)),
            num_blocks=8, has_delta=True, eps=1e-5, out_eps=1e-5, variant="fused")
        jax.jit(f).trace(s(4, 8, 3072), s(4, {H}, 3072), s(8, {H}), s(8, {NB}, {H}), s({H}),
                         s({H}), s({H}), s(5, 2, dtype=jnp.uint32), s(4, dtype=jnp.int32)).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    assert ".target sm_90a" in ptx and ".reqntid 256, 1, 1" in ptx
    assert f".minnctapersm {fused.MIN_CTAS_PER_SM}" in ptx
    assert ptx.count(".entry") == 1
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.nc.L1::no_allocate.L2::256B.v4.u32" in ptx
    assert "fence.release.sys" in ptx and "fence.acq_rel.sys" not in ptx
    # Publish: one store per rank's mailbox (TP 4), and the re-arms.
    assert ptx.count("st.relaxed.sys.global.v4.b32") >= 4 + 4
    # Polls: a first load and the loop's load per rank's slot.
    assert ptx.count("ld.relaxed.sys.global.v4.u32") >= 2 * 4
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "st.shared::cluster.f32" in ptx
    # Row after row: its exchanges keep the cluster barriers (no mbarrier phases to track).
    assert "st.async" not in ptx and "mbarrier" not in ptx
    if shutil.which("ptxas"):
        ptx_file = next(tmp_path.glob("*.ptx"))
        info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx_file), "-o",
                               str(tmp_path / "fused.cubin")], capture_output=True, text=True,
                              check=True).stderr
        spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
        registers = int(re.search(r"Used (\d+) registers", info).group(1))
        assert spilled <= 32 and registers <= 65536 // (256 * fused.MIN_CTAS_PER_SM), info
