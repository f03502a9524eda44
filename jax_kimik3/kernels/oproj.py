"""The post-attention tail on kernels: o_proj, its one-shot Lamport all-reduce, and AttnRes.

Three variants, chosen per (B, K per rank) by `tuning.tail_variant`:
- "split": 1. the producer kernel (kernels/producer.py) computes this rank's o_proj rows
  bf16(x @ w.T) and publishes them into slot `rank` of every rank's mailbox (one-shot), or
  each column chunk into its owner's receive slot (two-shot);
  2. two-shot only, owner (kernels/lamport.py): sums its chunk's T receive slots and sends the
  sum into every rank's gather region;
  3. the AttnRes kernel with a ring input (kernels/attn_res.py) polls this rank's T slots
  (two-shot: its gather region), sums them in rank order, re-arms them and runs the
  post-attention AttnRes; with `ahead` weights it also stores the saved blocks' statistics
  for the next call site.
- "xla": as "split", but XLA's dot and the Lamport publish kernel do step 1.
- "fused": both steps in ONE launch (`OprojAttnResFused`, kernels/fused.py): clusters of
  CLUSTER CTAs of WARPS·32 threads over a grid [CLUSTER, R·(N/16/CLUSTER + B)]:
  1. the first R·N/16 CTAs are producers: rank i's CTA j runs `OprojProducer.rows` on rows
     16j..16j+15 of rank i's w and publishes them (R ranks in one launch: virtual TP puts
     every rank on one GPU; on a mesh R = 1);
  2. the last R·B clusters are consumers, one per (rank, token row): THREADS threads of each
     CTA run `AttnResKernel.row` (poll, rank-order sum, re-arm, AttnRes); the CTA's other
     warps exit at once (CTA and cluster barriers wait only for threads that have not exited).
  No consumer waits on another consumer. The consumers come last in the grid, so with the
  hardware's in-order block dispatch every producer CTA has been dispatched (and so finishes)
  before any consumer starts to spin, even where the grid is far larger than what is resident
  at once (virtual TP 16: 16·(448 + 7B) CTAs). In-order dispatch is what GPUs do, not a CUDA
  guarantee: the polls stay bounded (`max_spins`; `Mailbox.check()` raises the timeout), so a
  violation reads as a TimeoutError, never a hung GPU.
The fused kernel is one-shot without `ahead`; a two-shot or `ahead` tail where the table says
"fused" runs "split". `two_shot=None` takes the variant `tuning.use_two_shot` gives.
Why a fused launch needs no fence of its own: layer L's re-arm and layer L+1's publish are in
different launches on one stream, as in "split" (kernels/lamport.py has the argument).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kimik3 import reference, tuning
from jax_kimik3.kernels import attn_res_ops, lamport_ops, producer_ops
from jax_kimik3.kernels.attn_res_ops import AttnResVariant
from jax_kimik3.kernels.launch import Variant, launch
from jax_kimik3.mailbox import MailboxLayout


def _variant(layout, parity, num_blocks, has_delta, eps, out_eps, out_norm, max_spins):
    return AttnResVariant(num_blocks, has_delta, -1, out_norm, False, float(eps), float(out_eps),
                          layout, parity, max_spins)


def fused_tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, ranks,
               layout: MailboxLayout, parity, num_blocks, has_delta, eps, out_eps,
               multicast=False, max_spins=lamport_ops.MAX_SPINS, into=None):
    """The fused kernel for R ranks at once: x [R, B, K], w [R, H, K], ranks int32 [R] (each
    rank's index in the mailbox); prefix, blocks and the weights are shared. Returns each
    rank's (out, new_prefix): [R, B, H] each. `into` = (out, new_prefix) buffers written in
    place (the GPU tests pass poisoned ones)."""
    r, b, k = x.shape
    publish = producer_ops.Publish(layout, parity, False, multicast)
    variant = _variant(layout, parity, num_blocks, has_delta, eps, out_eps,
                       out_norm_w is not None, max_spins)
    rows = jax.ShapeDtypeStruct((r, b, prefix.shape[1]), jnp.bfloat16)
    inputs = [x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table, ranks]
    aliases = {}
    if into is not None:
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
        inputs += list(into)
    return launch(Variant("fused", (r, b, k, publish, variant)), (rows, rows), aliases)(*inputs)


def _choose(variant, two_shot, batch, k, layout, ahead):
    """(variant, two_shot): what was asked for, else the tables'. The fused kernel is one-shot
    without statistics ahead: asked for, it runs one-shot; the table's fused runs split where
    two-shot or ahead is asked for or tabled."""
    if variant is not None and variant not in tuning.TAIL_VARIANT_NAMES:
        raise ValueError(f"variant={variant!r} must be one of {tuning.TAIL_VARIANT_NAMES}")
    if variant == "fused":
        if two_shot or ahead is not None:
            raise NotImplementedError(f"the fused tail is one-shot without ahead; got "
                                      f"{two_shot=}, ahead={ahead is not None}")
        return "fused", False
    if two_shot is None:
        two_shot = tuning.use_two_shot(batch, layout.tp)
    chosen = variant or tuning.tail_variant(batch, k)
    if chosen == "fused" and (two_shot or ahead is not None):
        chosen = "split"
    return chosen, two_shot


def _publish(variant, x, w, table, rank, *, layout, parity, two_shot=False, multicast=False):
    """Step 1 of "split" ("producer" kernel) or "xla" (dot + publish kernel): the token."""
    if variant == "split":
        return producer_ops.produce(x, w, table, rank, layout=layout, parity=parity,
                                    two_shot=two_shot, multicast=multicast)
    return lamport_ops.publish(reference.oproj_partial(x, w), table, rank, layout=layout,
                               parity=parity, two_shot=two_shot, multicast=multicast)


def oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, rank,
                   layout, parity, num_blocks, has_delta, eps, out_eps, multicast=False,
                   max_spins=lamport_ops.MAX_SPINS, ahead=None, two_shot=None, variant=None):
    """One rank's post-attention tail through the mailbox: (out, new_prefix, new_blocks), and
    with `ahead` (a later site's res_norm_w, res_proj_w) the saved blocks' statistics.
    `variant`: "fused", "split" or "xla"; None: `tuning.tail_variant`."""
    batch = x.shape[0]
    variant, two_shot = _choose(variant, two_shot, *x.shape, layout, ahead)
    if variant == "fused":
        out, new_prefix = fused_tail(
            x[None], w[None], prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table=table,
            ranks=rank, layout=layout, parity=parity, num_blocks=num_blocks,
            has_delta=has_delta, eps=eps, out_eps=out_eps, multicast=multicast,
            max_spins=max_spins)
        return out[0], new_prefix[0], blocks
    token = _publish(variant, x, w, table, rank, layout=layout, parity=parity,
                     two_shot=two_shot, multicast=multicast)
    if two_shot:
        token = lamport_ops.reduce_chunk(table, rank, token, layout=layout, parity=parity,
                                         batch=batch, max_spins=max_spins, multicast=multicast)
    ring = attn_res_ops.Ring(layout, parity, max_spins, two_shot, has_delta, table, rank, token)
    return attn_res_ops.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                                 num_blocks=num_blocks, delta=None, write_idx=-1, eps=eps,
                                 out_eps=out_eps, stats=None, ring=ring, ahead=ahead)


def tail_virtual(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, layout,
                 parity, num_blocks, has_delta, eps, out_eps, max_spins=lamport_ops.MAX_SPINS,
                 ahead=None, two_shot=None, variant=None, into=None):
    """Every rank on one GPU, from the ranks' shards x [T, B, K/T] and w [T, H, K/T]. "fused":
    one launch for all T ranks (rank r's consumer waits on rank r+1's producer: separate
    launches on one stream would deadlock); else every rank's publish, [every owner,] then
    every rank's AttnRes consumer. Returns each rank's (out, new_prefix): [T, B, H] each, and
    with `ahead` each rank's statistics (mixture [T, B, H], scal [T, B, 2]); `into` (fused
    only): poisoned (out, new_prefix) buffers [T, B, H] written in place."""
    tp, batch = x.shape[:2]
    variant, two_shot = _choose(variant, two_shot, *x.shape[1:], layout, ahead)
    if variant == "fused":
        return fused_tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table=table,
                          ranks=jnp.arange(tp, dtype=jnp.int32), layout=layout, parity=parity,
                          num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
                          max_spins=max_spins, into=into)
    if into is not None:
        raise NotImplementedError(f"into= is for the fused variant; got {variant=}")
    ranks = [jnp.full((1,), r, jnp.int32) for r in range(tp)]
    tokens = jnp.concatenate([_publish(variant, x[r], w[r], table, ranks[r], layout=layout,
                                       parity=parity, two_shot=two_shot) for r in range(tp)])
    if two_shot:
        tokens = jnp.concatenate([
            lamport_ops.reduce_chunk(table, ranks[r], tokens, layout=layout, parity=parity,
                                     batch=batch, max_spins=max_spins) for r in range(tp)])
    results = [attn_res_ops.attn_res(
        prefix, blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks, delta=None,
        write_idx=-1, eps=eps, out_eps=out_eps, stats=None,
        ring=attn_res_ops.Ring(layout, parity, max_spins, two_shot, has_delta, table,
                               ranks[r], tokens),
        ahead=ahead)
        for r in range(tp)]
    out, prefix = (jnp.stack([r[i] for r in results]) for i in (0, 1))
    if ahead is None:
        return out, prefix
    return out, prefix, tuple(jnp.stack([r[3][i] for r in results]) for i in (0, 1))
