"""CPU: the fused o_proj tail kernel (producer + AttnRes consumer in one launch) compiles for
sm_90a at every TP, in virtual TP and per mesh rank, and the tail takes the table's variant."""

import re
import shutil
import subprocess

import jax.numpy as jnp
import pytest

from jax_kimik3 import tuning
from jax_kimik3.mailbox import MailboxLayout
from tests.lowering import CUSTOM_CALL, kept_ptx, lower_for_cuda, spec

pytest.importorskip("cutlass")
from jax_kimik3.kernels import fused, oproj  # noqa: E402

H, K_TOTAL, NB = 7168, 12288, 8


def virtual(tp, b, *, num_blocks=4, has_delta=True, out_norm=True, variant="fused"):
    """The StableHLO of every rank's tail on one GPU at (TP, B)."""
    def f(x, w, prefix, blocks, g, proj, out_w, table):
        return oproj.tail_virtual(x, w, prefix, blocks, g, proj, out_w if out_norm else None,
                                  table=table, layout=MailboxLayout(tp), parity=1,
                                  num_blocks=num_blocks, has_delta=has_delta, eps=1e-5,
                                  out_eps=1e-5, variant=variant)
    return lower_for_cuda(f, spec(tp, b, K_TOTAL // tp), spec(tp, H, K_TOTAL // tp), spec(b, H),
                          spec(b, NB, H), spec(H), spec(H), spec(H),
                          spec(tp + 1, 2, dtype=jnp.uint32))


def one_rank(tp, b, variant=None):
    """The StableHLO of one mesh rank's tail (R = 1 per launch) at (TP, B)."""
    def f(x, w, prefix, blocks, g, proj, out_w, table, rank):
        return oproj.oproj_attn_res(x, w, prefix, blocks, g, proj, out_w, table=table, rank=rank,
                                    layout=MailboxLayout(tp), parity=0, num_blocks=8,
                                    has_delta=True, eps=1e-5, out_eps=1e-5, variant=variant)
    return lower_for_cuda(f, spec(b, K_TOTAL // tp), spec(H, K_TOTAL // tp), spec(b, H),
                          spec(b, NB, H), spec(H), spec(H), spec(H),
                          spec(tp + 1, 2, dtype=jnp.uint32), spec(1, dtype=jnp.int32))


@pytest.mark.parametrize("b", [1, 2, 5, 8, 9, 16, 64])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_fused_virtual_is_one_launch(tp, b):
    """All TP ranks' producers and consumers in one custom call (separate launches on one
    stream would deadlock: rank r's consumer waits on rank r+1's producer)."""
    text = virtual(tp, b)
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1
    assert "dot_general" not in text


@pytest.mark.parametrize("num_blocks,has_delta,out_norm", [(1, False, True), (1, True, True),
                                                           (4, True, False), (8, True, True),
                                                           (0, False, True)])
def test_fused_call_sites_lower(num_blocks, has_delta, out_norm):
    """Write layers (a new block, no delta), delta layers, K = 0..8, with and without norm."""
    assert CUSTOM_CALL in virtual(8, 8, num_blocks=num_blocks, has_delta=has_delta,
                                  out_norm=out_norm)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_fused_mesh_rank_is_one_launch(tp):
    text = one_rank(tp, 8, "fused")
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1


@pytest.mark.parametrize("b,tp", [(1, 8), (8, 16), (16, 8), (64, 8), (8, 1), (1, 2), (2, 2)])
def test_tail_takes_the_table_variant(b, tp):
    """tuning.tail_variant decides: fused (one call), split (producer + consumer: two calls),
    xla (dot, publish, consumer); a two-shot all-reduce adds the owner."""
    variant = tuning.tail_variant(b, K_TOTAL // tp)
    text = one_rank(tp, b)
    calls = len(re.findall(rf"custom_call @{CUSTOM_CALL}", text))
    assert calls == {"fused": 1, "split": 2, "xla": 2}[variant] + tuning.use_two_shot(b, tp)
    assert ("dot_general" in text) == (variant == "xla")


def test_table_is_one_table_of_known_variants():
    for k, entries in tuning.TAIL_VARIANTS.items():
        bounds = [b for b, _ in entries]
        assert bounds == sorted(bounds), k
        assert all(v in tuning.TAIL_VARIANT_NAMES for _, v in entries)
    assert tuning.tail_variant(4, 6144) == "fused" and tuning.tail_variant(5, 6144) == "split"
    assert tuning.tail_variant(4, 1536) == "fused" and tuning.tail_variant(16, 1536) == "split"
    assert tuning.tail_variant(17, 1536) == "xla" and tuning.tail_variant(1, 12288) == "xla"
    assert tuning.use_two_shot(64, 8) and not tuning.use_two_shot(63, 8)
    assert not tuning.use_two_shot(64, 2)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match=r"variant='two_shot' must be one of"):
        one_rank(8, 8, "two_shot")


def test_fused_refuses_what_it_does_not_do():
    from jax_kimik3.kernels.attn_res_ops import AttnResVariant
    from jax_kimik3.kernels.fused import OprojAttnResFused
    from jax_kimik3.kernels.producer_ops import Publish
    layout = MailboxLayout(8)
    ring = AttnResVariant(4, True, -1, True, False, 1e-5, 1e-5, layout, 0, 10)
    with pytest.raises(ValueError, match="must read a one-shot ring"):
        OprojAttnResFused(1, 8, 1536, Publish(layout, 0, False, False),
                                AttnResVariant(4, True, -1, True, False, 1e-5, 1e-5))
    with pytest.raises(ValueError, match="one-shot publish into the ring's slots"):
        OprojAttnResFused(1, 8, 1536, Publish(layout, 1, False, False), ring)
    with pytest.raises(ValueError, match="o_proj producer"):
        OprojAttnResFused(1, 65, 1536, Publish(layout, 0, False, False), ring)


def test_fused_ptx(tmp_path):
    """One sm_90a kernel of 256 threads with the producer's bf16 mma.sync and streamed weight
    loads, the publish stores into every rank's mailbox, the consumer's volatile polling loads,
    the cluster barriers and DSMEM stores of AttnRes; at most 64 registers (4 CTAs per SM:
    .minnctapersm) and, by ptxas where installed, no more than a word or two spilled."""
    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp
        from jax_kimik3.kernels import oproj
        from jax_kimik3.mailbox import MailboxLayout
        s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
        f = lambda x, w, p, bl, g, pw, o, t: oproj.tail_virtual(
            x, w, p, bl, g, pw, o, table=t, layout=MailboxLayout(4), parity=1, num_blocks=8,
            has_delta=True, eps=1e-5, out_eps=1e-5, variant="fused")
        jax.jit(f).trace(s(4, 8, 3072), s(4, {H}, 3072), s(8, {H}), s(8, {NB}, {H}), s({H}),
                         s({H}), s({H}), s(5, 2, dtype=jnp.uint32)).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    assert ".target sm_90a" in ptx and ".reqntid 256, 1, 1" in ptx
    assert f".minnctapersm {fused.MIN_CTAS_PER_SM}" in ptx
    assert ptx.count(".entry") == 1
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.nc.L1::no_allocate.L2::256B.v4.u32" in ptx
    # Publish: one store per rank's mailbox (TP 4); the re-arm, new prefix and out add more.
    assert ptx.count("st.global.v4.u32") >= 4 + 4
    # Polls: a first load and the loop's load per rank's slot.
    assert ptx.count("ld.volatile.global.v4.u32") >= 2 * 4
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "st.shared::cluster.f32" in ptx
    if shutil.which("ptxas"):
        ptx_file = next(tmp_path.glob("*.ptx"))
        info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx_file), "-o",
                               str(tmp_path / "fused.cubin")], capture_output=True, text=True,
                              check=True).stderr
        spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
        registers = int(re.search(r"Used (\d+) registers", info).group(1))
        assert spilled <= 16 and registers <= 65536 // (256 * fused.MIN_CTAS_PER_SM), info
