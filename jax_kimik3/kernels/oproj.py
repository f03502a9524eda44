"""The post-attention tail on kernels: o_proj rows, their Lamport publish, and the AttnRes
consumer that sums the mailbox slots (one-shot) before mixing.

1. o_proj: this rank's partial rows bf16(x @ w.T) (XLA's dot for now);
2. the one-shot producer of kernels/lamport.py publishes them into every rank's slot;
3. the AttnRes kernel with a ring input polls its slots, sums them in rank order, re-arms them
   and runs the post-attention AttnRes on the result (kernels/attn_res.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_kimik3 import reference
from jax_kimik3.kernels import attn_res as attn_res_kernels
from jax_kimik3.kernels import lamport


def oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, rank,
                   layout, parity, num_blocks, has_delta, eps, out_eps, multicast=False,
                   max_spins=lamport.MAX_SPINS):
    """One rank's post-attention tail through the mailbox: (out, new_prefix, new_blocks)."""
    partial = reference.oproj_partial(x, w)
    token = lamport.publish(partial, table, rank, layout=layout, parity=parity,
                            multicast=multicast)
    ring = attn_res_kernels.Ring(layout, parity, max_spins, has_delta, table, rank, token)
    return attn_res_kernels.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                                     num_blocks=num_blocks, delta=None, write_idx=-1, eps=eps,
                                     out_eps=out_eps, stats=None, ring=ring)


def tail_virtual(partials, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, layout,
                 parity, num_blocks, has_delta, eps, out_eps, max_spins=lamport.MAX_SPINS):
    """Every rank on one GPU, from the ranks' o_proj rows partials [T, B, H]: every publish,
    then every rank's AttnRes consumer. Returns each rank's (out, new_prefix): [T, B, H] each."""
    tp = partials.shape[0]
    ranks = [jnp.full((1,), r, jnp.int32) for r in range(tp)]
    tokens = jnp.concatenate([lamport.publish(partials[r], table, ranks[r], layout=layout,
                                              parity=parity) for r in range(tp)])
    results = [attn_res_kernels.attn_res(
        prefix, blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks, delta=None,
        write_idx=-1, eps=eps, out_eps=out_eps, stats=None,
        ring=attn_res_kernels.Ring(layout, parity, max_spins, has_delta, table, ranks[r], tokens))
        for r in range(tp)]
    return jnp.stack([r[0] for r in results]), jnp.stack([r[1] for r in results])
