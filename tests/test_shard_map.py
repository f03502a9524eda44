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

NB = k3.KIMI_K3.num_attn_res_blocks


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
@pytest.mark.parametrize("k_total", [12288])  # Kimi K3's: K per rank must add up to it
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_oproj_attn_res_matches_oracle(rng, tp, k_total, has_delta):
    assert len(jax.devices()) >= tp, "conftest asks XLA for 8 host devices"
    b, k = 8, 3
    inp = attn_res_inputs(rng, b, NB)
    x, _ = oproj_inputs(rng, b, k_total)
    w = _weights(k_total)
    out, prefix, blocks = _run(tp, x, w, inp, num_blocks=k, has_delta=has_delta)

    oracle.assert_tail_close(out, prefix, x, w, inp, tp=tp, num_blocks=k, has_delta=has_delta)
    np.testing.assert_array_equal(np.asarray(blocks), inp.blocks)


def test_oproj_attn_res_over_a_tuple_of_axes(rng):
    """axis_name=("dp", "tp") on a (2, 4) mesh: one TP group of 8 ranks over both axes."""
    b, k = 8, 3
    inp = attn_res_inputs(rng, b, NB)
    x, _ = oproj_inputs(rng, b, 12288)
    w = _weights(12288)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    step = functools.partial(k3.oproj_attn_res, axis_name=("dp", "tp"), num_blocks=k,
                             has_delta=True)
    shards = P(None, ("dp", "tp"))
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(shards, shards) + (P(),) * 5,
                                    out_specs=P()))
    out, prefix, _ = sharded(x, w, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                             inp.out_norm_w)

    oracle.assert_tail_close(out, prefix, x, w, inp, tp=8, num_blocks=k, has_delta=True)
