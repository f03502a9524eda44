"""The post-attention tail on kernels: the o_proj producer, then the AttnRes consumer.

1. producer: this rank's o_proj rows bf16(x @ w.T) into slot `rank` of every rank's mailbox
   (one-shot), or each column chunk into its owner's receive slot (two-shot): the producer
   kernel (kernels/producer.py, published straight from the GEMM) where `tuning.use_producer`
   says it wins, else XLA's dot and the Lamport publish kernel;
2. two-shot only, owner (kernels/lamport.py): sums its chunk's T receive slots and sends the
   sum into every rank's gather region;
3. consumer (kernels/attn_res.py with a ring input): polls this rank's T slots (two-shot: its
   gather region), sums them in rank order, re-arms them and runs the post-attention AttnRes
   on the result; with `ahead` weights it also stores the saved blocks' statistics for the
   next call site.
`two_shot=None` takes the variant `tuning.use_two_shot` gives for the batch and TP.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_kimik3 import reference, tuning
from jax_kimik3.kernels import attn_res as attn_res_kernels
from jax_kimik3.kernels import lamport, producer


def produce(x, w, table, rank, *, layout, parity, two_shot=False, multicast=False):
    """This rank's o_proj rows published at `parity` by the faster variant; its token."""
    if tuning.use_producer(*x.shape):
        return producer.produce(x, w, table, rank, layout=layout, parity=parity,
                                two_shot=two_shot, multicast=multicast)
    return lamport.publish(reference.oproj_partial(x, w), table, rank, layout=layout,
                           parity=parity, two_shot=two_shot, multicast=multicast)


def _two_shot(two_shot, batch, layout):
    return tuning.use_two_shot(batch, layout.tp) if two_shot is None else two_shot


def oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, rank,
                   layout, parity, num_blocks, has_delta, eps, out_eps, multicast=False,
                   max_spins=lamport.MAX_SPINS, ahead=None, two_shot=None):
    """One rank's post-attention tail through the mailbox: (out, new_prefix, new_blocks), and
    with `ahead` (a later site's res_norm_w, res_proj_w) the saved blocks' statistics."""
    two_shot = _two_shot(two_shot, x.shape[0], layout)
    token = produce(x, w, table, rank, layout=layout, parity=parity, two_shot=two_shot,
                    multicast=multicast)
    if two_shot:
        token = lamport.reduce_chunk(table, rank, token, layout=layout, parity=parity,
                                     batch=x.shape[0], max_spins=max_spins, multicast=multicast)
    ring = attn_res_kernels.Ring(layout, parity, max_spins, two_shot, has_delta, table, rank,
                                 token)
    return attn_res_kernels.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                                     num_blocks=num_blocks, delta=None, write_idx=-1, eps=eps,
                                     out_eps=out_eps, stats=None, ring=ring, ahead=ahead)


def tail_virtual(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, layout,
                 parity, num_blocks, has_delta, eps, out_eps, max_spins=lamport.MAX_SPINS,
                 ahead=None, two_shot=None):
    """Every rank on one GPU, from the ranks' shards x [T, B, K/T] and w [T, H, K/T]: every
    producer, [every owner,] then every rank's AttnRes consumer. Returns each rank's (out,
    new_prefix): [T, B, H] each, and with `ahead` each rank's statistics (mixture [T, B, H],
    scal [T, B, 2])."""
    tp, batch = x.shape[:2]
    two_shot = _two_shot(two_shot, batch, layout)
    ranks = [jnp.full((1,), r, jnp.int32) for r in range(tp)]
    tokens = jnp.concatenate([produce(x[r], w[r], table, ranks[r], layout=layout, parity=parity,
                                      two_shot=two_shot) for r in range(tp)])
    if two_shot:
        tokens = jnp.concatenate([
            lamport.reduce_chunk(table, ranks[r], tokens, layout=layout, parity=parity,
                                 batch=batch, max_spins=max_spins) for r in range(tp)])
    results = [attn_res_kernels.attn_res(
        prefix, blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks, delta=None,
        write_idx=-1, eps=eps, out_eps=out_eps, stats=None,
        ring=attn_res_kernels.Ring(layout, parity, max_spins, two_shot, has_delta, table,
                                   ranks[r], tokens),
        ahead=ahead)
        for r in range(tp)]
    out, prefix = (jnp.stack([r[i] for r in results]) for i in (0, 1))
    if ahead is None:
        return out, prefix
    return out, prefix, tuple(jnp.stack([r[3][i] for r in results]) for i in (0, 1))
