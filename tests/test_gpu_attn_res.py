"""GPU: every AttnRes kernel variant against the jitted reference, outputs poisoned first."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimik3 as k3
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs
from tests import oracle

pytestmark = pytest.mark.gpu

BATCHES = (1, 2, 7, 8, 16, 33, 64)
# K = 3 and 4: the most saved blocks with one cluster exchange per row, the fewest with two.
KS = (0, 1, 3, 4, 8)
H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks
VARIANTS = list(itertools.product((True, False), (False, True), (True, False), (False, True)))
VARIANT_IDS = ["-".join(n for n, on in zip(("delta", "write", "norm", "stats"), v) if on) or "plain"
               for v in VARIANTS]


def poisoned(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)


@functools.partial(jax.jit, static_argnames=("num_blocks", "has_delta", "write_idx", "out_norm",
                                             "precomputed", "use_kernel"))
def run(inp, poison, *, num_blocks, has_delta, write_idx, out_norm, precomputed, use_kernel):
    from jax_kimik3.kernels import attn_res_ops as kernels

    stats = None
    if precomputed:
        stats = reference.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w,
                                              num_blocks=num_blocks, eps=1e-5)
    args = (inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
            inp.out_norm_w if out_norm else None)
    kwargs = dict(num_blocks=num_blocks, delta=inp.delta if has_delta else None,
                  write_idx=write_idx, eps=1e-5, out_eps=1e-5, stats=stats)
    if use_kernel:
        return kernels.attn_res(*args, **kwargs, into=poison[: 1 + has_delta])
    return reference.attn_res(*args, **kwargs)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b", BATCHES)
def test_attn_res_kernel_matches_reference(rng, b, k, variant):
    has_delta, write, out_norm, precomputed = variant
    if write and k == NB:
        pytest.skip("no slot left to write after 8 saved blocks")
    inp = jax.device_put(attn_res_inputs(rng, b, NB))
    poison = (poisoned((b, H), jnp.bfloat16), poisoned((b, H), jnp.bfloat16))
    static = dict(num_blocks=k, has_delta=has_delta, write_idx=k if write else -1,
                  out_norm=out_norm, precomputed=precomputed)
    out, prefix, blocks = run(inp, poison, **static, use_kernel=True)
    want_out, want_prefix, want_blocks = run(inp, poison, **static, use_kernel=False)
    # Same fp32 add and bf16 rounding: the prefix and every block must match bit for bit.
    np.testing.assert_array_equal(np.asarray(prefix), np.asarray(want_prefix))
    np.testing.assert_array_equal(np.asarray(blocks), np.asarray(want_blocks))
    # Two fp32 computations (other summation order, approximate exp/rsqrt) rounded to bf16:
    # at most one bf16 ulp apart, plus fp32 noise where the mix cancels.
    oracle.assert_bf16_close(out, np.asarray(want_out, np.float64), "out")


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b", BATCHES)
def test_statistics_kernel_matches_reference(rng, b, k):
    from jax_kimik3.kernels import attn_res_ops as kernels

    inp = jax.device_put(attn_res_inputs(rng, b, NB))
    into = (poisoned((b, H), jnp.float32), poisoned((b, 2), jnp.float32))
    got = jax.jit(lambda i, p: kernels.attn_res_statistics(
        i.blocks, i.res_norm_w, i.res_proj_w, num_blocks=k, eps=1e-5, into=p))(inp, into)
    want = jax.jit(lambda i: reference.attn_res_statistics(
        i.blocks, i.res_norm_w, i.res_proj_w, num_blocks=k, eps=1e-5))(inp)
    mixture, scal = map(np.asarray, got)
    want_mixture, want_scal = map(np.asarray, want)
    np.testing.assert_allclose(scal, want_scal, rtol=oracle.F32_RTOL, atol=oracle.F32_RTOL)
    oracle.assert_mixture_close(mixture, want_mixture, inp.blocks, k)


@pytest.mark.parametrize("k", (1, 4, 8))
@pytest.mark.parametrize("b", BATCHES)
def test_statistics_ahead_match_reference(rng, b, k):
    """The AttnRes kernel that also stores a later site's statistics: every output poisoned,
    out and prefix as without them, the statistics as the statistics kernel's."""
    from jax_kimik3.kernels import attn_res_ops as kernels

    inp, later = (jax.device_put(attn_res_inputs(rng, b, NB)) for _ in range(2))
    into = (poisoned((b, H), jnp.bfloat16), poisoned((b, H), jnp.bfloat16),
            poisoned((b, H), jnp.float32), poisoned((b, 2), jnp.float32))
    args = lambda i: (i.prefix, i.blocks, i.res_norm_w, i.res_proj_w, i.out_norm_w)
    static = dict(num_blocks=k, write_idx=-1, eps=1e-5, out_eps=1e-5, stats=None)
    out, prefix, _, (mixture, scal) = jax.jit(lambda i, j, p: kernels.attn_res(
        *args(i), delta=i.delta, ahead=(j.res_norm_w, j.res_proj_w), into=p, **static))(
        inp, later, into)
    want_out, want_prefix, _ = jax.jit(lambda i: reference.attn_res(
        *args(i), delta=i.delta, **static))(inp)
    np.testing.assert_array_equal(np.asarray(prefix), np.asarray(want_prefix))
    oracle.assert_bf16_close(out, np.asarray(want_out, np.float64), "out")
    acc, m, s = oracle.statistics(inp.blocks, later.res_norm_w, later.res_proj_w, num_blocks=k)
    np.testing.assert_allclose(np.asarray(scal), np.stack([m, s], -1), rtol=oracle.F32_RTOL,
                               atol=oracle.F32_RTOL)
    oracle.assert_mixture_close(mixture, acc, inp.blocks, k)


def test_auto_backend_picks_the_kernel_on_gpu(rng):
    inp = attn_res_inputs(rng, 8, NB)
    f = jax.jit(lambda i: k3.attn_res(i.prefix, i.blocks, i.res_norm_w, i.res_proj_w,
                                      i.out_norm_w, num_blocks=4, delta=i.delta))
    assert "CuteDSLRT_NvJaxCutlassCall" in f.lower(inp).as_text()
    out, _, _ = f(inp)
    want, _, _ = reference.attn_res(inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                                    inp.out_norm_w, num_blocks=4, delta=inp.delta)
    oracle.assert_bf16_close(out, np.asarray(want, np.float64), "auto out")
