"""CPU: AttentionTail applies each layer's plan (blocks, delta, block write) to the
public calls, against the float64 model."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from tests import oracle

H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


def weights(inp):
    return k3.AttnResWeights(inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)


@pytest.mark.parametrize("index", [0, 12, 13, 92])
def test_pre_attention_follows_the_plan(rng, index):
    plan = k3.KIMI_K3.layer(index)
    site = plan.pre_attention
    inp = attn_res_inputs(rng, 4, NB)
    delta = inp.delta if site.has_delta else None
    out, prefix, blocks = k3.AttentionTail(plan).pre_attention(weights(inp), inp.prefix,
                                                                inp.blocks, delta)
    want_out, want_prefix, want_blocks = oracle.attn_res(
        inp.prefix, inp.blocks, *weights(inp), num_blocks=site.num_blocks, delta=delta,
        write_idx=site.write_idx)
    np.testing.assert_array_equal(np.asarray(prefix), want_prefix)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)  # the write, if any
    oracle.assert_bf16_close(out, want_out, "out")


def test_delta_must_match_the_plan(rng):
    inp = attn_res_inputs(rng, 2, NB)
    tail = k3.AttentionTail(k3.KIMI_K3.layer(5))
    with pytest.raises(ValueError, match="pre_attention: delta=None, but the plan says "
                                         "has_delta=True"):
        tail.pre_attention(weights(inp), inp.prefix, inp.blocks)
    with pytest.raises(ValueError, match="final: delta=None"):
        k3.final_attn_res(weights(inp), inp.prefix, inp.blocks, None, num_layers=5)


@pytest.mark.parametrize("index", [0, 3])
def test_post_attention_under_shard_map(rng, index):
    """TP 2 on host devices: the plan's K and delta (layer 0 starts a block, 3 adds a delta)."""
    plan, tp, b = k3.KIMI_K3.layer(index), 2, 4
    site = plan.post_attention
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    step = jax.jit(jax.shard_map(
        functools.partial(k3.AttentionTail(plan).post_attention, weights(inp)),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(), P()), out_specs=P()))
    out, prefix, blocks = step(x, w, inp.prefix, inp.blocks)
    oracle.assert_tail_close(out, prefix, x, w, inp, tp=tp, num_blocks=site.num_blocks,
                             has_delta=site.has_delta)
    np.testing.assert_array_equal(np.asarray(blocks), inp.blocks)


@pytest.mark.parametrize("index", [0, 13, 24])
def test_pre_attention_with_statistics_ahead(rng, index):
    """Statistics of the saved blocks computed ahead stand in for them (24: a write layer)."""
    tail = k3.AttentionTail(k3.KIMI_K3.layer(index))
    site = tail.plan.pre_attention
    inp = attn_res_inputs(rng, 4, NB)
    delta = inp.delta if site.has_delta else None
    stats = tail.pre_attention_statistics(weights(inp), inp.blocks)
    out, prefix, blocks = tail.pre_attention(weights(inp), inp.prefix, inp.blocks, delta, stats)
    want_out, want_prefix, want_blocks = oracle.attn_res(
        inp.prefix, inp.blocks, *weights(inp), num_blocks=site.num_blocks, delta=delta,
        write_idx=site.write_idx)
    np.testing.assert_array_equal(np.asarray(prefix), want_prefix)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)
    oracle.assert_bf16_close(out, want_out, "out")


@pytest.mark.parametrize("index,num_layers", [(0, 4), (11, 13), (12, 13), (92, 93)])
def test_post_attention_statistics_ahead(rng, index, num_layers):
    """The next call site's statistics (its weights, the blocks this tail mixes) come back as
    a fourth result, and stand in for the blocks there (12 -> 13: write layer, then delta)."""
    plan, tp, b = k3.KIMI_K3.layer(index), 2, 4
    inp, following = attn_res_inputs(rng, b, NB), attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    step = jax.jit(jax.shard_map(
        functools.partial(k3.AttentionTail(plan).post_attention, weights(inp),
                          ahead=weights(following)),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(), P()), out_specs=P()))
    out, prefix, blocks, stats = step(x, w, inp.prefix, inp.blocks)
    k = plan.post_attention.num_blocks
    assert isinstance(stats, k3.AttnResStatistics) and stats.num_blocks == k
    mixture, scal = stats
    acc, m, s = oracle.statistics(inp.blocks, following.res_norm_w, following.res_proj_w,
                                  num_blocks=k)
    np.testing.assert_allclose(np.asarray(scal), np.stack([m, s], -1), rtol=oracle.F32_RTOL)
    oracle.assert_mixture_close(mixture, acc, inp.blocks, k)
    # The next site with these statistics, against the float64 model reading the blocks.
    if index + 1 < num_layers:
        site = k3.KIMI_K3.layer(index + 1).pre_attention
        got = k3.AttentionTail(k3.KIMI_K3.layer(index + 1)).pre_attention(
            weights(following), prefix, blocks, following.delta, stats)[0]
    else:
        site = k3.KIMI_K3.final(num_layers)
        got = k3.final_attn_res(weights(following), prefix, blocks, following.delta,
                                stats=stats, num_layers=num_layers)
    want = oracle.attn_res(prefix, blocks, *weights(following), num_blocks=site.num_blocks,
                           delta=following.delta, write_idx=site.write_idx)[0]
    oracle.assert_bf16_close(got, want, "next site's out")


@pytest.mark.parametrize("index", [12, 13])  # without and with the delta
@pytest.mark.parametrize("tp", [4, 8])
def test_post_attention_sums_in_fp32_in_rank_order(rng, tp, index):
    """On inputs whose o_proj rows are exact, every rank's new prefix is bit for bit the
    ranks' rows summed in fp32 in rank order and rounded once (then the delta add); these
    inputs tell that sum from one rounded to bf16 at each add."""
    site, b = k3.KIMI_K3.layer(index).post_attention, 3
    inp = attn_res_inputs(rng, b, NB)
    x, w = oracle.exact_oproj_inputs(rng, b, k3.KIMI_K3.o_proj_in_features, H)
    xs, ws = (np.stack(np.split(a, tp, axis=-1)) for a in (x, w))
    prefix = np.asarray(k3.oproj_attn_res_virtual(
        xs, ws, inp.prefix, inp.blocks, *weights(inp), num_blocks=site.num_blocks,
        has_delta=site.has_delta)[1])
    want = oracle.exact_tail_prefix(x, w, inp.prefix, tp=tp, has_delta=site.has_delta)
    for r in range(tp):
        np.testing.assert_array_equal(prefix[r].view(np.uint16), want.view(np.uint16))
    partials = oracle.oproj_partials(list(xs), list(ws))
    running = partials[0]
    for p in partials[1:]:
        running = oracle.to_bf16(oracle.f64(running) + oracle.f64(p))
    assert (running != oracle.rank_order_sum(partials)).mean() > 0.05


@pytest.mark.parametrize("index,ahead", [(0, False), (3, True), (46, False)])
def test_post_attention_virtual(rng, index, ahead):
    """Every rank on one device (the reference path): each rank's result within bf16 of the
    float64 model of the TP-rank tail, the ranks identical, statistics ahead as the model's."""
    plan, tp, b = k3.KIMI_K3.layer(index), 4, 3
    site = plan.post_attention
    inp, later = attn_res_inputs(rng, b, NB), attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    xs, ws = (np.stack(np.split(a, tp, axis=-1)) for a in (x, w))
    results = k3.oproj_attn_res_virtual(
        xs, ws, inp.prefix, inp.blocks, *weights(inp), num_blocks=site.num_blocks,
        has_delta=site.has_delta, ahead=(later.res_norm_w, later.res_proj_w) if ahead else None)
    out, prefix = map(np.asarray, results[:2])
    assert out.shape == prefix.shape == (tp, b, H)
    for r in range(tp):
        np.testing.assert_array_equal(out[r], out[0])
        np.testing.assert_array_equal(prefix[r], prefix[0])
    oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp, num_blocks=site.num_blocks,
                             has_delta=site.has_delta)
    tail = k3.AttentionTail(plan).post_attention_virtual(
        weights(inp), xs, ws, inp.prefix, inp.blocks,
        ahead=weights(later) if ahead else None)
    np.testing.assert_array_equal(np.asarray(tail[0]), out[0])
    if ahead:
        acc, m, s = oracle.statistics(inp.blocks, later.res_norm_w, later.res_proj_w,
                                      num_blocks=site.num_blocks)
        mixture, scal = map(np.asarray, results[3])
        for r in range(tp):
            np.testing.assert_allclose(scal[r], np.stack([m, s], -1), rtol=oracle.F32_RTOL)
            oracle.assert_mixture_close(mixture[r], acc, inp.blocks, site.num_blocks)
        np.testing.assert_array_equal(np.asarray(tail[3][0]), mixture[0])
