"""The post-attention tail of R ranks as one call (sm_90a): the rows' producer, the two-shot
owner where asked, then the AttnRes kernel that completes the all-reduce ("split" and "xla"
in kernels/oproj.py, which has the algorithm; the fused tail is kernels/fused.py).

The kernels run back to back on the call's stream, so the AttnRes kernel's polls never wait
on a CTA of a later launch, and no other mailbox call can run between them. Each after the
first is a programmatic dependent launch: it starts while the producer streams its weight.
The AttnRes kernel reads its saved blocks and weights then, and sums each row of the mailbox
as it lands; it waits for the kernels before it only to advance the call (docs/protocol.md,
"Dependent launches").
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from jax_kimik3.kernels.attn_res import HIDDEN, AttnResKernel, AttnResTensors
from jax_kimik3.kernels.geometry import HOLDING_MAX_BATCH, TOKENS
from jax_kimik3.kernels.variants import AttnResVariant
from jax_kimik3.kernels.lamport import AllReduce
from jax_kimik3.kernels.producer import OprojProducer, is_staged
from jax_kimik3.kernels.variants import Publish


class Tail:
    """R ranks' tails: o_proj rows from the producer kernel (x [R·B, K], w [R·H, K]) or from
    XLA's dot (rows [R·B, H], published by the Lamport publish kernel), all-reduced into the
    AttnRes kernel: out, new_prefix [R·B, H] (and ahead, mixture [R·B, H], scal [R·B, 2])."""

    def __init__(self, tiles: int | None, k: int | None, variant: AttnResVariant):
        reduction = variant.reduction
        if reduction is None:
            raise ValueError(f"tail: {variant=} must complete a mailbox reduction")
        if (tiles is None) != (k is None):
            raise ValueError(f"tail: the producer kernel needs its B tiles and K; got "
                             f"{tiles=}, {k=} (both None: rows from XLA's dot)")
        self.variant = variant
        self.all_reduce = AllReduce(reduction.spec, reduction.ranks, reduction.two_shot)
        self.producer = None if k is None else OprojProducer(
            tiles, k, HIDDEN, Publish(reduction.spec, reduction.two_shot), reduction.ranks,
            staged=is_staged(tiles, k))
        # Rows from the producer come in B tiles; rows from XLA's dot, at any B.
        self.consumer = AttnResKernel(
            variant, holding=tiles is not None and tiles * TOKENS <= HOLDING_MAX_BATCH)

    @cute.jit
    def __call__(self, stream, x, w, rows, prefix: cute.Tensor, blocks: cute.Tensor,
                 res_norm_w: cute.Tensor, res_proj_w: cute.Tensor, out_norm_w, ahead_norm_w,
                 ahead_proj_w, table: cute.Tensor, ranks: cute.Tensor, out: cute.Tensor,
                 new_prefix: cute.Tensor, ahead_mixture=None, ahead_scal=None):
        batch = cute.size(prefix, mode=[0])
        if cutlass.const_expr(self.producer is not None):
            self.producer.launch(stream, x, w, table, ranks)
        else:
            self.all_reduce.launch_publish(stream, rows, table, ranks, batch)
        self.all_reduce.launch_owner(stream, table, ranks, batch)
        self.consumer.launch(stream, AttnResTensors(
            prefix=prefix, blocks=blocks, res_norm_w=res_norm_w, res_proj_w=res_proj_w,
            out_norm_w=out_norm_w, ahead_norm_w=ahead_norm_w, ahead_proj_w=ahead_proj_w,
            table=table, ranks=ranks, out=out, new_prefix=new_prefix,
            ahead_mixture=ahead_mixture, ahead_scal=ahead_scal))


@functools.cache
def tail_kernel(tiles, k, variant):
    """`tiles`, `k`: the producer kernel's B tiles and K, or None, None for rows from XLA's
    dot; every batch is read at run time."""
    return Tail(tiles, k, variant)
