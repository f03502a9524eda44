"""The pure-JAX reference (through the public API) against the float64 NumPy oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimik3 as k3
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs
from tests import oracle

BATCHES = (1, 3, 8, 33, 64)
KS = (0, 1, 4, 8)
NB = k3.KIMI_K3.num_attn_res_blocks


def _weights(inp, out_norm):
    return inp.res_norm_w, inp.res_proj_w, (inp.out_norm_w if out_norm else None)


@pytest.mark.parametrize("out_norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b", BATCHES)
def test_attn_res_matches_oracle(rng, b, k, has_delta, out_norm):
    inp = attn_res_inputs(rng, b, NB)
    delta = inp.delta if has_delta else None
    out, prefix, blocks = k3.attn_res(inp.prefix, inp.blocks, *_weights(inp, out_norm),
                                      num_blocks=k, delta=delta)
    want_out, want_prefix, want_blocks = oracle.attn_res(
        inp.prefix, inp.blocks, *_weights(inp, out_norm), num_blocks=k, delta=delta)
    assert out.dtype == prefix.dtype == blocks.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(prefix), want_prefix)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)
    oracle.assert_bf16_close(out, want_out, "out")


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("k,write_idx", [(0, 0), (1, 1), (4, 4), (4, 7), (7, 7)])
@pytest.mark.parametrize("b", (1, 8, 64))
def test_block_write(rng, b, k, write_idx, has_delta):
    inp = attn_res_inputs(rng, b, NB)
    delta = inp.delta if has_delta else None
    out, prefix, blocks = k3.attn_res(inp.prefix, inp.blocks, *_weights(inp, True),
                                      num_blocks=k, delta=delta, write_idx=write_idx)
    want_out, want_prefix, want_blocks = oracle.attn_res(
        inp.prefix, inp.blocks, *_weights(inp, True), num_blocks=k, delta=delta,
        write_idx=write_idx)
    np.testing.assert_array_equal(np.asarray(blocks)[:, write_idx], want_prefix)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)
    np.testing.assert_array_equal(np.asarray(prefix), want_prefix)
    oracle.assert_bf16_close(out, want_out, "out")


def test_zero_blocks_mix_is_the_prefix(rng):
    """K = 0: the softmax has one source, so the mix is the (updated) prefix itself."""
    inp = attn_res_inputs(rng, 4, NB)
    out, prefix, _ = k3.attn_res(inp.prefix, inp.blocks, *_weights(inp, False), num_blocks=0,
                                 delta=inp.delta)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(prefix))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b", BATCHES)
def test_statistics_match_oracle(rng, b, k):
    inp = attn_res_inputs(rng, b, NB)
    mixture, scal = k3.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w,
                                           num_blocks=k)
    assert mixture.dtype == scal.dtype == jnp.float32
    assert mixture.shape == (b, inp.prefix.shape[1]) and scal.shape == (b, 2)
    acc, m, s = oracle.statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w, num_blocks=k)
    np.testing.assert_allclose(np.asarray(scal[:, 0]), m, rtol=oracle.F32_RTOL, atol=oracle.F32_RTOL)
    np.testing.assert_allclose(np.asarray(scal[:, 1]), s, rtol=oracle.F32_RTOL)
    oracle.assert_mixture_close(mixture, acc, inp.blocks, k)


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b", BATCHES)
def test_statistics_combine_matches_direct(rng, b, k, has_delta):
    inp = attn_res_inputs(rng, b, NB)
    delta = inp.delta if has_delta else None
    stats = k3.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w, num_blocks=k)
    args = (inp.prefix, inp.blocks, *_weights(inp, True))
    direct, p_direct, _ = k3.attn_res(*args, num_blocks=k, delta=delta)
    combined, p_combined, _ = k3.attn_res(*args, num_blocks=k, delta=delta, stats=stats)
    np.testing.assert_array_equal(np.asarray(p_combined), np.asarray(p_direct))
    want, _, _ = oracle.attn_res(*args, num_blocks=k, delta=delta)
    oracle.assert_bf16_close(combined, want, "combined out")
    # Both are roundings of fp32 values within fp32 noise of each other: one ulp at most.
    np.testing.assert_allclose(oracle.f64(combined), oracle.f64(direct), rtol=oracle.BF16_RTOL,
                               atol=oracle.ROW_ATOL * np.abs(want).max())


def test_oracle_tolerance_catches_a_one_percent_error(rng):
    """The tolerance is tight enough to see a 1% error in a single element."""
    inp = attn_res_inputs(rng, 2, NB)
    want, _, _ = oracle.attn_res(inp.prefix, inp.blocks, *_weights(inp, True), num_blocks=4)
    i = np.unravel_index(np.argmax(np.abs(want)), want.shape)
    bad = want.copy()
    bad[i] *= 1.01
    with pytest.raises(AssertionError, match="1 of"):
        oracle.assert_bf16_close(oracle.to_bf16(bad), want, "perturbed")


def test_nan_stays_in_its_row(rng):
    """A NaN in one row's input makes that row's out NaN (its norm and softmax mix every
    column) and only its own element of the new prefix; the other rows are untouched."""
    inp = attn_res_inputs(rng, 3, 8)
    prefix = np.asarray(inp.prefix).copy()
    prefix[1, 5] = np.nan
    out, new_prefix, _ = reference.attn_res(jnp.asarray(prefix), inp.blocks, inp.res_norm_w,
                                            inp.res_proj_w, inp.out_norm_w, num_blocks=4,
                                            delta=inp.delta)
    out, new_prefix = (np.asarray(a, np.float32) for a in (out, new_prefix))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
    assert np.isnan(new_prefix).sum() == 1 and np.isnan(new_prefix[1, 5])


@pytest.mark.parametrize("rms,finite_norm", [(2e16, True), (1e17, True), (6e17, False),
                                             (2e19, False)])
def test_rms_norm_range(rng, rms, finite_norm):
    """The fp32 RMSNorm normalises rows whose RMS is below ~2e17 (mean(x²) must stay under the
    fp32 maximum); above, mean(x²) overflows to inf and the row's out is 0 (README)."""
    inp = attn_res_inputs(rng, 2, 8)
    prefix = np.asarray(inp.prefix, np.float32)
    prefix = prefix * (rms / np.sqrt(np.mean(prefix.astype(np.float64) ** 2, -1, keepdims=True)))
    out = np.asarray(reference.attn_res(jnp.asarray(prefix, jnp.bfloat16), inp.blocks,
                                        inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
                                        num_blocks=0)[0], np.float32)
    assert np.isfinite(out).all()
    rms_out = np.sqrt(np.mean(out.astype(np.float64) ** 2, -1))
    if finite_norm:  # out_norm_w ~ 1: unit RMS
        assert ((rms_out > 0.5) & (rms_out < 2)).all()
    else:
        assert (out == 0).all()


def test_relative_error_is_the_l2_ratio_in_float64():
    want = np.array([3.0, 4.0], np.float32)
    assert reference.relative_error(want, want) == 0.0
    assert reference.relative_error(np.array([3.0, 4.5]), want) == pytest.approx(0.1, abs=1e-15)
    # bf16 inputs, computed in float64: one ulp of 1.0 apart in one element of two
    got, want = (jnp.asarray(v, jnp.bfloat16) for v in ([1.0 + 2.0**-7, 2.0], [1.0, 2.0]))
    assert reference.relative_error(got, want) == pytest.approx(2.0**-7 / np.sqrt(5), rel=1e-12)
