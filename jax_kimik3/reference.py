"""Block AttnRes, o_proj and its all-reduce in pure JAX: the oracle of every kernel and the XLA baseline.

fp32 arithmetic, bf16 storage (docs/model.md):
1. prefix update: p = bf16(fp32(prefix) + fp32(delta)); a block write stores p to blocks[:, write_idx];
2. logit of a source v: z(v) = rsqrt(mean(v²) + eps) · Σ_d v[d]·g[d]·w[d];
3. mix = Σ_i softmax(z)_i · v_i over the saved blocks b_0..b_{K-1} and p;
4. out = bf16(RMSNorm(mix) · out_w), or bf16(mix) without an output norm.
The statistics (m, s, acc) of the saved blocks can be precomputed and combined with p later.
Inputs are assumed valid; `jax_kimik3.api` checks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kimik3.config import KIMI_K3

F32, BF16 = jnp.float32, jnp.bfloat16
EPS = KIMI_K3.rms_norm_eps  # RMSNorm's epsilon, logits' and output norm's alike


def relative_error(got, want) -> float:
    """‖got − want‖ / ‖want‖ over every element (L2, float64 on the host): how the example,
    the benchmarks and the sanitizer workload hold a result against its reference."""
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def round_bf16(x):
    """fp32 `x` rounded to bf16 values, kept in fp32. XLA may skip a convert pair inside a fusion
    (excess precision); an explicit reduce_precision it keeps."""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def logits(v, res_norm_w, res_proj_w, eps):
    """z(v) for rows v [..., H] (any float dtype) → fp32 [...]."""
    v = v.astype(F32)
    gw = res_norm_w.astype(F32) * res_proj_w.astype(F32)
    return jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps) * jnp.sum(v * gw, axis=-1)


def rms_norm(x, weight, eps):
    """RMSNorm of fp32 rows x [..., H], times weight when it is given; fp32."""
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x if weight is None else x * weight.astype(F32)


def update_prefix(prefix, blocks, *, delta, write_idx):
    """Step 1: the bf16 prefix after its delta, and the blocks after the optional write."""
    p = prefix if delta is None else round_bf16(prefix.astype(F32) + delta.astype(F32)).astype(BF16)
    if write_idx >= 0:
        blocks = blocks.at[:, write_idx].set(p)
    return p, blocks


def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps):
    """(mixture [B, H] f32, scal [B, 2] f32) = (Σ e^{z_i−m} b_i, (m, Σ e^{z_i−m})) over blocks[:, :K]."""
    b, _, h = blocks.shape
    if num_blocks == 0:
        scal = jnp.stack([jnp.full((b,), -jnp.inf, F32), jnp.zeros((b,), F32)], axis=-1)
        return jnp.zeros((b, h), F32), scal
    saved = blocks[:, :num_blocks].astype(F32)
    z = logits(saved, res_norm_w, res_proj_w, eps)  # [B, K]
    m = jnp.max(z, axis=-1)
    e = jnp.exp(z - m[:, None])
    mixture = jnp.einsum("bk,bkh->bh", e, saved)
    return mixture, jnp.stack([m, jnp.sum(e, axis=-1)], axis=-1)


def combine(mixture, scal, p, z_p):
    """mix = (c·acc + w_p·p) / (c·s + w_p) with M = max(m, z_p), c = e^{m−M}, w_p = e^{z_p−M}."""
    m, s = scal[:, 0], scal[:, 1]
    top = jnp.maximum(m, z_p)
    c, w_p = jnp.exp(m - top), jnp.exp(z_p - top)
    mix = c[:, None] * mixture + w_p[:, None] * p.astype(F32)
    return mix / (c * s + w_p)[:, None]


def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta=None,
             write_idx=-1, eps=EPS, out_eps=EPS, stats=None):
    """(out [B, H] bf16, new_prefix [B, H] bf16, new_blocks [B, NB, H] bf16); see the module docstring.

    `stats` = (mixture, scal) of blocks[:, :num_blocks] replaces the softmax over the saved blocks.
    """
    p, new_blocks = update_prefix(prefix, blocks, delta=delta, write_idx=write_idx)
    if stats is None:
        sources = jnp.concatenate([blocks[:, :num_blocks], p[:, None]], axis=1).astype(F32)
        a = jax.nn.softmax(logits(sources, res_norm_w, res_proj_w, eps), axis=-1)
        mix = jnp.einsum("bk,bkh->bh", a, sources)
    else:
        mix = combine(*stats, p, logits(p, res_norm_w, res_proj_w, eps))
    out = mix if out_norm_w is None else rms_norm(mix, out_norm_w, out_eps)
    return out.astype(BF16), p, new_blocks


def oproj_partial(x, w):
    """One rank's o_proj rows: bf16(x @ w.T) with fp32 accumulation, as published to the mailbox."""
    return round_bf16(jnp.einsum("bk,hk->bh", x, w, preferred_element_type=F32)).astype(BF16)


def all_reduce_ranks(partials, axis_name=None):
    """Sum of the ranks' bf16 rows [R, B, H] in fp32, in rank order, then over `axis_name`
    where given (a mesh device holds R = 1), rounded to bf16: the mailbox all-reduce's
    result."""
    acc = partials[0].astype(F32)
    for partial in partials[1:]:
        acc = acc + partial.astype(F32)
    if axis_name is not None:
        acc = jax.lax.psum(acc, axis_name)
    return round_bf16(acc).astype(BF16)


def all_reduce(partial, axis_name):
    """`all_reduce_ranks` of this device's rows [B, H] inside shard_map."""
    return all_reduce_ranks(partial[None], axis_name)


def oproj_attn_res_ranks(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *,
                         num_blocks, has_delta, axis_name=None, eps=EPS, out_eps=EPS):
    """Post-attention tail of R ranks' shards x [R, B, K_local], w [R, H, K_local]: o_proj
    partials, their all-reduce (over the leading axis, then `axis_name`), AttnRes.

    With `has_delta` the reduced attn_out is the delta of `prefix`; without it attn_out starts
    a new block and is the returned prefix (`prefix` is then not read).
    """
    return post_attention(all_reduce_ranks(jax.vmap(oproj_partial)(x, w), axis_name), prefix,
                          blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks,
                          has_delta=has_delta, eps=eps, out_eps=out_eps)


def oproj_attn_res_virtual(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *,
                           num_blocks, has_delta, eps=EPS, out_eps=EPS):
    """The tail of every rank on one device: x [TP, B, K/TP], w [TP, H, K/TP]."""
    return oproj_attn_res_ranks(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                                num_blocks=num_blocks, has_delta=has_delta, eps=eps,
                                out_eps=out_eps)


def post_attention(attn_out, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks,
                   has_delta, eps, out_eps):
    """The post-attention AttnRes of the all-reduced `attn_out`: the delta of `prefix`, or
    (without `has_delta`) a new block's prefix."""
    if has_delta:
        return attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                        num_blocks=num_blocks, delta=attn_out, eps=eps, out_eps=out_eps)
    return attn_res(attn_out, blocks, res_norm_w, res_proj_w, out_norm_w,
                    num_blocks=num_blocks, eps=eps, out_eps=out_eps)
