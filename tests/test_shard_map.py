"""`oproj_attn_res` under shard_map on host devices against the float64 oracle."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from tests import oracle

NB = 8


@functools.cache
def _weights(k_total):
    """One o_proj weight per K_total for the module (88M random numbers take seconds)."""
    _, w = oproj_inputs(np.random.default_rng(k_total), 1, k_total)
    return w


def _run(tp, x, w, inp, *, num_blocks, has_delta):
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    step = functools.partial(k3.oproj_attn_res, axis_name="tp", num_blocks=num_blocks,
                             has_delta=has_delta)
    sharded = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 5, out_specs=P()))
    return sharded(x, w, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
@pytest.mark.parametrize("k_total", [12288, 1536])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_oproj_attn_res_matches_oracle(rng, tp, k_total, has_delta):
    assert len(jax.devices()) >= tp, "conftest asks XLA for 8 host devices"
    b, k = 8, 3
    inp = attn_res_inputs(rng, b, NB)
    x, _ = oproj_inputs(rng, b, k_total)
    w = _weights(k_total)
    out, prefix, blocks = _run(tp, x, w, inp, num_blocks=k, has_delta=has_delta)

    shards = np.split(np.arange(k_total), tp)
    x_shards, w_shards = [x[:, s] for s in shards], [w[:, s] for s in shards]
    partials = oracle.oproj_partials(x_shards, w_shards)
    attn_out = oracle.all_reduce(partials)
    want_prefix = oracle.prefix_update(inp.prefix, attn_out) if has_delta else attn_out
    # The package's dots accumulate in fp32 (DOT_RTOL); then each bf16 partial, their sum and
    # the prefix add may each round one ulp away from the float64 path (BF16_RTOL each).
    magnitude = sum(np.abs(oracle.f64(p)) for p in partials) + np.abs(oracle.f64(want_prefix))
    bound = (2 * oracle.BF16_RTOL * magnitude
             + oracle.DOT_RTOL * oracle.dot_scale(x_shards, w_shards))
    err = np.abs(oracle.f64(prefix) - oracle.f64(want_prefix))
    assert (err <= bound).all(), f"attn_out: worst err/bound {np.max(err / bound):.3g}"
    # The AttnRes stage, on the package's own prefix: exact block pass-through, oracle out.
    want_out, _, _ = oracle.attn_res(np.asarray(prefix), inp.blocks, inp.res_norm_w,
                                     inp.res_proj_w, inp.out_norm_w, num_blocks=k)
    oracle.assert_bf16_close(out, want_out, "out")
    np.testing.assert_array_equal(np.asarray(blocks), inp.blocks)
