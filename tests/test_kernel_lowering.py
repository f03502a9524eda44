"""CPU: every AttnRes kernel variant compiles for sm_90a and lowers to the cutlass_call custom call."""

import itertools
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import jax_kimik3 as k3
from jax_kimik3.kernels.geometry import STANDALONE_VECTOR
from tests.lowering import CUSTOM_CALL, entries, kept_ptx, lower_for_cuda, spec

pytest.importorskip("cutlass")

H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


VARIANTS = [  # (K, delta, write, out norm, precomputed statistics)
    v for v in itertools.product((0, 1, 4, 8), (True, False), (False, True), (True, False),
                                 (False, True))
    if not (v[2] and v[0] == NB)  # no slot left to write after 8 saved blocks
]


@pytest.mark.parametrize("k,has_delta,write,out_norm,precomputed", VARIANTS)
def test_attn_res_variant_lowers(k, has_delta, write, out_norm, precomputed):
    b = 8
    write_idx = k if write else -1

    def f(prefix, delta, blocks, g, w, o, mixture, scal):
        return k3.attn_res(prefix, blocks, g, w, o if out_norm else None, num_blocks=k,
                           delta=delta if has_delta else None, write_idx=write_idx,
                           stats=k3.AttnResStatistics(mixture, scal, k) if precomputed else None,
                           backend="kernel")

    text = lower_for_cuda(f, spec(b, H), spec(b, H), spec(b, NB, H), spec(H), spec(H), spec(H),
                          spec(b, H, dtype=jnp.float32), spec(b, 2, dtype=jnp.float32))
    assert len(re.findall(rf"custom_call @{CUSTOM_CALL}", text)) == 1
    # The block write updates `blocks` in place: the custom call aliases it to an output.
    assert ("output_operand_aliases" in text) == write


@pytest.mark.parametrize("k", [1, 4, 8])
def test_statistics_ahead_lower_as_two_more_outputs(k):
    """The post-attention kernel with a later site's weights: one custom call whose results
    are out, new prefix, mixture f32 [B, H] and scal f32 [B, 2]."""
    from jax_kimik3.kernels import attn_res_ops as kernels

    def f(prefix, delta, blocks, g, w, o, g2, w2):
        return kernels.attn_res(prefix, blocks, g, w, o, num_blocks=k, delta=delta, write_idx=-1,
                                eps=1e-5, out_eps=1e-5, stats=None, ahead=(g2, w2))

    text = lower_for_cuda(f, spec(8, H), spec(8, H), spec(8, NB, H), *[spec(H)] * 5)
    call = re.search(rf"custom_call @{CUSTOM_CALL}.*", text).group(0)
    assert re.search(r"-> \(tensor<8x7168xbf16>, tensor<8x7168xbf16>, tensor<8x7168xf32>, "
                     r"tensor<8x2xf32>\)", call), call[-300:]


def test_statistics_ahead_need_the_blocks():
    from jax_kimik3.kernels.variants import AttnResVariant

    with pytest.raises(ValueError, match="statistics ahead need the saved blocks"):
        AttnResVariant(num_blocks=4, has_delta=True, write_idx=-1, out_norm=True,
                       precomputed=True, eps=1e-5, out_eps=1e-5, ahead=True)


@pytest.mark.parametrize("b", [1, 2, 7, 33, 64])
def test_attn_res_lowers_for_every_batch(b):
    text = lower_for_cuda(
        lambda p, d, bl, g, w, o: k3.attn_res(p, bl, g, w, o, num_blocks=4, delta=d,
                                              backend="kernel"),
        spec(b, H), spec(b, H), spec(b, NB, H), spec(H), spec(H), spec(H))
    assert CUSTOM_CALL in text


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_statistics_lowers(k):
    text = lower_for_cuda(
        lambda bl, g, w: k3.attn_res_statistics(bl, g, w, num_blocks=k, backend="kernel"),
        spec(8, NB, H), spec(H), spec(H))
    assert (CUSTOM_CALL in text) == (k > 0)  # K = 0 needs no kernel: the constants of an empty softmax


def test_auto_backend_on_cpu_is_the_reference():
    text = lower_for_cuda(
        lambda p, bl, g, w, o: k3.attn_res(p, bl, g, w, o, num_blocks=4),
        spec(8, H), spec(8, NB, H), spec(H), spec(H), spec(H))
    assert CUSTOM_CALL not in text


def test_kernel_backend_needs_model_width():
    with pytest.raises(ValueError, match="built for H=7168; got H=256"):
        jax.jit(lambda p, bl, g, w: k3.attn_res(p, bl, g, w, None, num_blocks=1,
                                                 backend="kernel")).trace(
            spec(8, 256), spec(8, NB, 256), spec(256), spec(256))


def test_bad_backend_is_a_value_error():
    with pytest.raises(ValueError, match=r"backend='cuda' must be one of \('auto', 'kernel', 'reference'\)"):
        jax.jit(lambda p, bl, g, w: k3.attn_res(p, bl, g, w, None, num_blocks=1,
                                                 backend="cuda")).trace(
            spec(8, H), spec(8, NB, H), spec(H), spec(H))


def standalone_script(k):
    """A script that lowers the standalone AttnRes kernel (delta, output norm, B = 4) over K = k
    saved blocks; `s` builds its bf16 shapes."""
    return f"""
        import jax, jax.numpy as jnp, jax_kimik3 as k3
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        f = lambda p, d, bl, g, w, o: k3.attn_res(p, bl, g, w, o, num_blocks={k}, delta=d,
                                                  backend="kernel")
        jax.jit(f).trace(s(4, {H}), s(4, {H}), s(4, {NB}, {H}), s({H}), s({H}), s({H})).lower(
            lowering_platforms=("cuda",))
    """


def test_ptx_is_hopper_cluster_code(tmp_path):
    """The kept PTX targets sm_90a and reduces across the cluster through DSMEM."""
    ptx = kept_ptx(standalone_script(3), tmp_path)
    assert ".target sm_90a" in ptx
    # The cluster syncs once (relaxed), then the exchanges land on mbarriers.
    assert "barrier.cluster.arrive.relaxed" in ptx and "barrier.cluster.wait" in ptx
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32" in ptx
    assert "mapa.shared::cluster" in ptx and "fence.mbarrier_init.release.cluster" in ptx
    # The expected bytes are armed after the cluster barrier, not beside mbarrier.init: the
    # init's warp and thread 0's arrive are then ordered by barriers (racecheck).
    order = [ptx.index(op) for op in ("mbarrier.init", "barrier.cluster.arrive.relaxed",
                                      "barrier.cluster.wait", "mbarrier.arrive.expect_tx",
                                      "mbarrier.try_wait")]
    assert order == sorted(order), order
    # The wait acquires at cluster scope, the peers' stores' release scope.
    assert ptx.count("mbarrier.try_wait") == ptx.count("mbarrier.try_wait.parity.acquire.cluster")
    # The row's vectors move in one access each: STANDALONE_VECTOR bf16, as 32-bit words.
    words = STANDALONE_VECTOR // 2
    assert f"ld.global.v{words}" in ptx and f"st.global.v{words}" in ptx


@pytest.mark.parametrize("blocks, stats, exchanges", [(-1, False, 1), (0, False, 2), (8, True, 1)],
                         ids=["most_saved_blocks_with_one", "fewest_with_two", "precomputed"])
def test_output_norm_shares_the_logits_exchange(tmp_path, blocks, stats, exchanges):
    """Over up to GRAM_MAX_SOURCES sources (K saved blocks and p), or precomputed statistics,
    the output norm's Σmix² comes from the logits' cluster exchange (the pair sums of the
    sources, or of the mixture and p): one exchange per row (a wait on its mbarrier); over
    more, two. No exchange is a cluster barrier's release arrive (a GPU-scope fence)."""
    from jax_kimik3.kernels.geometry import GRAM_MAX_SOURCES

    k = blocks if stats else GRAM_MAX_SOURCES + blocks  # K + 1 sources: at the bound, above it
    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp, jax_kimik3 as k3
        s = lambda *shape, t=jnp.bfloat16: jax.ShapeDtypeStruct(shape, t)
        def f(p, d, bl, g, w, o, m, c):
            stats = k3.AttnResStatistics(m, c, {k}) if {stats} else None
            return k3.attn_res(p, bl, g, w, o, num_blocks={k}, delta=d, stats=stats,
                               backend="kernel")
        jax.jit(f).trace(s(4, {H}), s(4, {H}), s(4, {NB}, {H}), s({H}), s({H}), s({H}),
                         s(4, {H}, t=jnp.float32), s(4, 2, t=jnp.float32)).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    bodies = [body for name, body in entries(ptx) if "AttnRes" in name]
    assert len(bodies) == 1
    assert len(re.findall(r"mbarrier\.try_wait", bodies[0])) == exchanges
    assert not re.findall(r"barrier\.cluster\.arrive(?!\.relaxed)", bodies[0])


@pytest.mark.parametrize("k", [1, 4, 8])
def test_standalone_kernel_reads_each_input_once(tmp_path, k):
    """The standalone AttnRes kernel holds the saved blocks in registers from their partial
    sums to the mix: one 16-byte load per thread of each of its K blocks and of the prefix,
    delta and three weight vectors, none read again after the exchange."""
    bodies = [body for name, body in entries(kept_ptx(standalone_script(k), tmp_path))
              if "AttnRes" in name]
    assert len(bodies) == 1
    assert len(re.findall(r"ld\.global\.", bodies[0])) == k + 5


def test_standalone_kernels_have_a_register_budget(tmp_path):
    """The standalone AttnRes and statistics kernels carry `.minnctapersm`: with a budget ptxas
    issues every saved block's load at once (without one it holds K = 8 to about 75
    registers and loads the last blocks a memory round trip later), within what
    STANDALONE_CTAS_PER_SM CTAs of their threads per SM leave, without spilling."""
    from jax_kimik3.kernels.geometry import (STANDALONE_CTAS_PER_SM, STANDALONE_VECTOR,
                                             cta_threads)

    ptx = kept_ptx(standalone_script(8) + f"""
        st = lambda bl, g, w: k3.attn_res_statistics(bl, g, w, num_blocks=8, backend="kernel")
        jax.jit(st).trace(s(4, {NB}, {H}), s({H}), s({H})).lower(lowering_platforms=("cuda",))
    """, tmp_path)
    heads = [entry[:entry.find("{")] for entry in re.split(r"\.entry ", ptx)[1:]]
    kernels = [head for head in heads if "AttnResKernel" in head or "StatisticsKernel" in head]
    assert len(kernels) == 2
    for head in kernels:  # the directives between the parameters and the body
        assert f".minnctapersm {STANDALONE_CTAS_PER_SM}" in head, head[:120]
    if shutil.which("ptxas"):
        for i, ptx_file in enumerate(sorted(tmp_path.glob("*.ptx"))):
            info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx_file), "-o",
                                   str(tmp_path / f"{i}.cubin")], capture_output=True,
                                  text=True, check=True).stderr
            for registers in map(int, re.findall(r"Used (\d+) registers", info)):
                assert registers <= 65536 // (cta_threads(STANDALONE_VECTOR)
                                              * STANDALONE_CTAS_PER_SM), info
            assert not re.search(r"[1-9]\d* bytes spill stores", info), info


def test_every_kernel_object_takes_its_signature():
    """Each family's kernel object takes (stream, *inputs, *outputs) by the names of the
    Signature its calls are built from, in order: a parameter added on one side only fails."""
    import inspect

    from jax_kimik3.kernels import (attn_res, attn_res_ops, fused, lamport, lamport_ops, oproj,
                                    producer, producer_ops, tail)

    pairs = [(attn_res.AttnResKernel, attn_res_ops.SIGNATURE),
             (attn_res.StatisticsKernel, attn_res_ops.STATISTICS),
             (lamport.AllReduce, lamport_ops.ALL_REDUCE),
             (lamport.ArmedCheck, lamport_ops.ARMED_CHECK),
             (producer.OprojProducer, producer_ops.PROJECT),
             (tail.Tail, oproj.TAIL),
             (fused.OprojAttnResFused, oproj.FUSED)]
    for kernel, signature in pairs:
        names = list(inspect.signature(inspect.unwrap(kernel.__call__)).parameters)
        assert names[:2] == ["self", "stream"], kernel
        assert tuple(names[2:]) == signature.inputs + signature.outputs, kernel


def test_signature_refuses_unknown_names_and_misplaced_buffers():
    from jax_kimik3.kernels.launch import Signature, Variant

    sig = Signature(inputs=("a", "b"), outputs=("out", "extra"))
    variant = Variant("oproj", (1, 256, 16))
    with pytest.raises(ValueError, match=r"oproj: no parameter\(s\) \['c'\]"):
        sig.call(variant, {"a": 1, "c": 2}, {})
    with pytest.raises(ValueError, match=r"into=\['extra'\] must be the first outputs"):
        sig.call(variant, {"a": 1}, {}, into={"extra": jnp.zeros(1)})


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_pairs_taken_in_two_runs_come_back_in_mix_order(k):
    """A tail sums the saved blocks' pair sums before its poll and each block's pair with p
    after it; `in_pair_order` puts them back in `pair_partials` order over [b_0..b_{K-1}, p],
    the order `mix_squares` reads (labels stand in for the sums)."""
    from jax_kimik3.kernels.attn_res import in_pair_order

    sources = k + 1  # the blocks, then p
    want = [(i, j) for i in range(sources) for j in range(i + 1, sources)]
    among = [(i, j) for i in range(k) for j in range(i + 1, k)]
    with_p = [(i, k) for i in range(k)]
    assert in_pair_order(among, with_p) == want
