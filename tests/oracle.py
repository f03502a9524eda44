"""An independent float64 NumPy model of the attention tail (docs/model.md); imports nothing of jax_kimik3.

Storage points round to bf16 as the specification says (the prefix add in fp32, each rank's
published o_proj rows, the all-reduced sum); everything else is float64.
"""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
# Tolerances, from bf16 arithmetic:
# - a bf16 output is the float64 value rounded once (half an ulp, <= 2**-8 relative); fp32
#   accumulation in the package can move a value across a rounding boundary, so allow one
#   whole ulp: 2**-7 relative.
# - fp32 accumulation (7168-term sums, softmax weights) is ~1e-5 of the row's scale; where
#   the mix cancels to near zero the relative bound says nothing, so allow 2**-12 of the
#   row's RMS as an absolute floor.
BF16_RTOL = 2.0**-7
ROW_ATOL = 2.0**-12
# An fp32 dot over K terms is off by about sqrt(K)·2**-24 of Σ|x·w| (111·6e-8 at K = 12288);
# 2**-14 of Σ|x·w| leaves a wide margin and still sees any misplaced shard.
DOT_RTOL = 2.0**-14
# fp32 results (mixture, s, m) against float64: the logit's 7168-term fp32 sum is off by
# ~1e-6 of its magnitude; exp() carries that into the weights. 2**-14 leaves a wide margin.
F32_RTOL = 2.0**-14


def f64(a):
    return np.asarray(a).astype(np.float64)


def to_bf16(a):
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16)


def logits(v, g, w, eps):
    """z(v) = Σ v·g·w / sqrt(mean(v²) + eps) over the last axis, float64."""
    v = f64(v)
    return np.sum(v * f64(g) * f64(w), -1) / np.sqrt(np.mean(v * v, -1) + eps)


def prefix_update(prefix, delta):
    """bf16(fp32(prefix) + fp32(delta)), the one rounding the specification puts in fp32."""
    if delta is None:
        return np.asarray(prefix)
    return (np.asarray(prefix).astype(np.float32) + np.asarray(delta).astype(np.float32)).astype(BF16)


def attn_res(prefix, blocks, g, w, out_w, *, num_blocks, delta=None, write_idx=-1, eps=1e-5,
             out_eps=1e-5):
    """(out float64 [B, H], new_prefix bf16, new_blocks bf16)."""
    p = prefix_update(prefix, delta)
    new_blocks = np.array(blocks)
    if write_idx >= 0:
        new_blocks[:, write_idx] = p
    sources = np.concatenate([f64(blocks)[:, :num_blocks], f64(p)[:, None]], axis=1)
    z = logits(sources, g, w, eps)
    a = np.exp(z - z.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    mix = np.einsum("bk,bkh->bh", a, sources)
    if out_w is not None:
        mix = mix / np.sqrt(np.mean(mix * mix, -1, keepdims=True) + out_eps) * f64(out_w)
    return mix, p, new_blocks


def statistics(blocks, g, w, *, num_blocks, eps=1e-5):
    """(acc [B, H], m [B], s [B]) of blocks[:, :K], float64."""
    saved = f64(blocks)[:, :num_blocks]
    if num_blocks == 0:
        b, _, h = saved.shape
        return np.zeros((b, h)), np.full(b, -np.inf), np.zeros(b)
    z = logits(saved, g, w, eps)
    m = z.max(-1)
    e = np.exp(z - m[:, None])
    return np.einsum("bk,bkh->bh", e, saved), m, e.sum(-1)


def assert_mixture_close(mixture, acc, blocks, num_blocks):
    """fp32 `mixture` [B, H] against the float64 `acc` of `statistics`: it cancels
    element-wise, so its error is bounded by F32_RTOL of the terms' magnitudes, Σ_k |b_k|."""
    scale = np.abs(f64(blocks)[:, :num_blocks]).sum(1)
    err = np.abs(f64(mixture) - acc)
    assert (err <= F32_RTOL * scale).all(), f"mixture off by {np.nanmax(err):.3g}"


def oproj_partials(x_shards, w_shards):
    """Each rank's o_proj rows, computed in float64 and published as bf16."""
    return [to_bf16(f64(x) @ f64(w).T) for x, w in zip(x_shards, w_shards)]


def dot_scale(x_shards, w_shards):
    """Σ_r |x_r|·|w_r|ᵀ: the magnitude that bounds the fp32 error of the o_proj dots."""
    return sum(np.abs(f64(x)) @ np.abs(f64(w)).T for x, w in zip(x_shards, w_shards))


def all_reduce(partials):
    """bf16 of the float64 sum of the ranks' bf16 rows."""
    return to_bf16(sum(f64(p) for p in partials))


def rank_order_sum(partials):
    """The all-reduce's specified result: an fp32 sum in rank order, rounded to bf16 (overflow
    to inf and inf - inf = nan happen as in fp32, which a float64 sum does not model)."""
    acc = np.asarray(partials[0]).astype(np.float32)
    for p in partials[1:]:
        acc = acc + np.asarray(p).astype(np.float32)
    return acc.astype(BF16)


def assert_bf16_close(actual, expected, what=""):
    """bf16 `actual` against float64 `expected` within BF16_RTOL + ROW_ATOL·rms(row)."""
    actual, expected = f64(actual), f64(expected)
    rms = np.sqrt(np.mean(expected**2, axis=-1, keepdims=True))
    bound = BF16_RTOL * np.abs(expected) + ROW_ATOL * rms
    err = np.abs(actual - expected)
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} elements off; worst err/bound="
        f"{np.nanmax(err / bound):.3g} at {np.unravel_index(np.nanargmax(err / bound), err.shape)}")


def tail_products(x, w, tp):
    """(each rank's bf16 o_proj rows, their fp32 error scale) of x [B, K], w [H, K] split over
    `tp` ranks along K: the expensive part of `assert_tail_close`, to compute once."""
    shards = np.split(np.arange(x.shape[1]), tp)
    x_shards, w_shards = [x[:, s] for s in shards], [w[:, s] for s in shards]
    return oproj_partials(x_shards, w_shards), dot_scale(x_shards, w_shards)


# bf16 values of 3-bit significands: ±1..7 · 2^-3..0. A product of two is a multiple of 2^-6
# no larger than 49, so an fp32 sum of them is exact while it stays below 2^18 in magnitude
# (a sum of 12288 random-signed products has σ of about 730).
SHORT_BF16 = np.array([sign * i * 2.0**-e for sign in (-1, 1) for i in range(1, 8)
                       for e in range(4)], np.float32).astype(BF16)


def exact_oproj_inputs(rng, batch, k_total, hidden):
    """(x [B, K], w [H, K]) of SHORT_BF16 values: every rank's o_proj dot is exact in fp32, so
    its published row is the float64 value rounded once, and the all-reduce's own rounding
    alone decides each reduced element (a sum rounded at each add differs in many)."""
    def draw(shape):
        return SHORT_BF16[rng.integers(0, SHORT_BF16.size, shape, dtype=np.uint8)]
    return draw((batch, k_total)), draw((hidden, k_total))


def exact_tail_prefix(x, w, prefix, *, tp, has_delta):
    """The new prefix of a tail on `exact_oproj_inputs` split over `tp` ranks, bit for bit:
    the ranks' rows summed in fp32 in rank order and rounded once, then added to `prefix`."""
    shards = np.split(np.arange(x.shape[1]), tp)
    attn_out = rank_order_sum(oproj_partials([x[:, s] for s in shards],
                                             [w[:, s] for s in shards]))
    return prefix_update(prefix, attn_out) if has_delta else attn_out


def assert_tail_close(out, prefix, x, w, inp, *, tp, num_blocks, has_delta, products=None):
    """One rank's post-attention tail (out, new prefix) from x [B, K], w [H, K] split over `tp`
    ranks along K, and AttnResInputs `inp`, against this model (`products`: their
    `tail_products`, if computed already)."""
    partials, scale = products or tail_products(x, w, tp)
    attn_out = all_reduce(partials)
    want_prefix = prefix_update(inp.prefix, attn_out) if has_delta else attn_out
    # The package's dots accumulate in fp32 (DOT_RTOL); then each bf16 partial, their sum and
    # the prefix add may each round one ulp away from the float64 path (BF16_RTOL each).
    magnitude = sum(np.abs(f64(p)) for p in partials) + np.abs(f64(want_prefix))
    bound = 2 * BF16_RTOL * magnitude + DOT_RTOL * scale
    err = np.abs(f64(prefix) - f64(want_prefix))
    assert (err <= bound).all(), f"attn_out: worst err/bound {np.max(err / bound):.3g}"
    # The AttnRes stage, on the package's own prefix.
    want_out, _, _ = attn_res(np.asarray(prefix), inp.blocks, inp.res_norm_w, inp.res_proj_w,
                              inp.out_norm_w, num_blocks=num_blocks)
    assert_bf16_close(out, want_out, "out")
