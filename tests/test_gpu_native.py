"""GPU: the kernel calls of a decode step (the library's catalog) against the float64 model.
Every call here is one `jax_kimik3.kernels.catalog` lists, so with JAX_KIMIK3_KERNELS=aot they
run from the prebuilt library, without the CuTe DSL (scripts/device_checks.sh aot)."""

import jax
import numpy as np
import pytest

import jax_kimik3 as k3
from jax_kimik3.config import KIMI_K3
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from jax_kimik3.mailbox import Mailbox
from tests import oracle

pytestmark = pytest.mark.gpu
NB = KIMI_K3.num_attn_res_blocks
# Pre-attention sites: the first block write (0, K = 0), a later one (12, K = 1), a delta
# layer (46, K = 4), the last layer (92, K = 8).
LAYERS = [0, 12, 46, 92]


def weights(inp):
    return k3.AttnResWeights(res_norm_w=inp.res_norm_w, res_proj_w=inp.res_proj_w,
                             out_norm_w=inp.out_norm_w)


@pytest.mark.parametrize("stats_ahead", [False, True], ids=["blocks", "stats_ahead"])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("b", [1, 8, 64])
def test_pre_attention(rng, b, layer, stats_ahead):
    tail = k3.AttentionTail(KIMI_K3.layer(layer), backend="kernel")
    site = tail.plan.pre_attention
    inp = attn_res_inputs(rng, b, NB)
    delta = inp.delta if site.has_delta else None

    @jax.jit
    def run(inp):
        stats = (tail.pre_attention_statistics(weights(inp), inp.blocks) if stats_ahead
                 else None)
        return tail.pre_attention(weights(inp), inp.prefix, inp.blocks,
                                  inp.delta if site.has_delta else None, stats)

    out, prefix, blocks = map(np.asarray, run(jax.device_put(inp)))
    want_out, want_prefix, want_blocks = oracle.attn_res(
        inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
        num_blocks=site.num_blocks, delta=delta, write_idx=site.write_idx)
    oracle.assert_bf16_close(out, want_out, "out")
    np.testing.assert_array_equal(prefix.view(np.uint16), want_prefix.view(np.uint16))
    np.testing.assert_array_equal(blocks.view(np.uint16), want_blocks.view(np.uint16))


@pytest.mark.parametrize("num_layers", [1, 13, 93])
def test_final(rng, num_layers):
    inp = attn_res_inputs(rng, 8, NB)
    out = jax.jit(lambda i: k3.final_attn_res(weights(i), i.prefix, i.blocks, i.delta,
                                              num_layers=num_layers, backend="kernel"))(
        jax.device_put(inp))
    want, _, _ = oracle.attn_res(inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                                 inp.out_norm_w, num_blocks=KIMI_K3.final(num_layers).num_blocks,
                                 delta=inp.delta)
    oracle.assert_bf16_close(np.asarray(out), want, "final out")


@pytest.mark.parametrize("ahead", [False, True], ids=["tail", "stats_ahead"])
@pytest.mark.parametrize("layer", [0, 46])
@pytest.mark.parametrize("b", [1, 4, 8, 33])
def test_post_attention_tail_on_a_mesh(rng, b, layer, ahead):
    """The tail as a decode step runs it (one rank per launch, the library's calls), on a TP
    mesh of every GPU here (TP 1 on one): ranks bitwise equal, within bf16 (statistics: fp32)
    of the model, every slot re-armed."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    tp = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    site = KIMI_K3.layer(layer).post_attention
    inp, later = attn_res_inputs(rng, b, NB), attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    with Mailbox.for_devices(devices) as mailbox:
        def tail(x, w, prefix, blocks, g, proj, out_w, g2, proj2):
            results = k3.oproj_attn_res(
                x, w, prefix, blocks, g, proj, out_w, axis_name="tp",
                num_blocks=site.num_blocks, has_delta=site.has_delta, mailbox=mailbox,
                ahead=(g2, proj2) if ahead else None, backend="kernel")
            return jax.tree.map(lambda a: a[None], (results[0], results[1], *results[3:]))
        run = jax.jit(jax.shard_map(tail, mesh=mesh, in_specs=(P(None, "tp"),) * 2 + (P(),) * 7,
                                    out_specs=P("tp")))
        results = run(x, w, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                      inp.out_norm_w, later.res_norm_w, later.res_proj_w)
        out, prefix = map(np.asarray, results[:2])
        mailbox.check()
        assert mailbox.unarmed() == 0
    for r in range(1, tp):
        np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
        np.testing.assert_array_equal(prefix[r].view(np.uint16), prefix[0].view(np.uint16))
    oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp, num_blocks=site.num_blocks,
                             has_delta=site.has_delta)
    if ahead:
        mixture, scal = map(np.asarray, results[2])
        acc, m, s = oracle.statistics(inp.blocks, later.res_norm_w, later.res_proj_w,
                                      num_blocks=site.num_blocks)
        for r in range(tp):
            np.testing.assert_allclose(scal[r], np.stack([m, s], -1), rtol=oracle.F32_RTOL,
                                       atol=oracle.F32_RTOL)
            oracle.assert_mixture_close(mixture[r], acc, inp.blocks, site.num_blocks)
