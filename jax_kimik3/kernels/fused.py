"""The fused post-attention tail (sm_90a): o_proj producer CTAs and AttnRes consumer clusters
in one launch ("fused" in kernels/oproj.py, which has the algorithm and launches it).

Its CTAs run `OprojProducer.rows` (kernels/producer.py) or `AttnResKernel.row`
(kernels/attn_res.py); this module holds the launch geometry and the register cap.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from jax_kimik3.kernels import attn_res as attn_res_kernels
from jax_kimik3.kernels import producer
from jax_kimik3.kernels.attn_res import CLUSTER, HIDDEN, THREADS
from jax_kimik3.kernels.attn_res_ops import AttnResVariant
from jax_kimik3.kernels.primitives import WARP, vectors
from jax_kimik3.kernels.producer_ops import Publish

PRODUCER_CLUSTERS = HIDDEN // producer.ROWS // CLUSTER  # 64 clusters of 7 CTAs per rank
# Register cap through .minnctapersm: 4 CTAs of 256 threads per SM (<= 64 registers). The
# consumer role alone would take 72 and the producer 40 (B <= 8; 68 at B = 64) (ptxas, sm_90a):
# uncapped, the fused kernel's producer CTAs would fit 3 per SM, 396 on 132 SMs, fewer than one
# rank's 448. At 64 the consumer spills 8 bytes (ptxas -v); 4 per SM holds 528 CTAs: one
# rank's 448 producers and 7·B consumers for B <= 11, if the clusters place.
MIN_CTAS_PER_SM = 4
assert PRODUCER_CLUSTERS * CLUSTER * producer.ROWS == HIDDEN and THREADS <= producer.WARPS * WARP


class OprojAttnResFused:
    """The fused tail for `ranks` ranks: x [R, B, K], w [R, H, K], ranks int32 [R] →
    out, new_prefix [R, B, H] (each rank's post-attention AttnRes on the all-reduce)."""

    def __init__(self, ranks: int, batch: int, k: int, publish: Publish,
                 variant: AttnResVariant):
        if (variant.ring is None or variant.two_shot or variant.ahead or variant.write_idx >= 0
                or variant.precomputed):
            raise ValueError(f"fused o_proj tail: {variant=} must read a one-shot ring, write "
                             "no block, compute its statistics and store none ahead")
        if publish.two_shot or publish.layout != variant.ring or publish.parity != variant.parity:
            raise ValueError(f"fused o_proj tail: one-shot publish into the ring's slots; got "
                             f"{publish=} for ring {variant.ring}, parity {variant.parity}")
        self.ranks, self.batch, self.k = ranks, batch, k
        self.producer = producer.OprojProducer(batch, k, HIDDEN, publish)
        self.consumer = attn_res_kernels.AttnResKernel(variant)

    @property
    def smem_bytes(self) -> int:
        """Both roles' shared memory: the DSL lays out every allocation of the kernel, of
        either branch, one after the other (taking the larger one overflowed: illegal address
        on the H200)."""
        return self.producer.smem_bytes + attn_res_kernels._smem_bytes(2, self.consumer.exchanged)

    @property
    def grid(self) -> list:
        return [CLUSTER, self.ranks * (PRODUCER_CLUSTERS + self.batch), 1]

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, w: cute.Tensor, prefix: cute.Tensor,
                 blocks: cute.Tensor, res_norm_w: cute.Tensor, res_proj_w: cute.Tensor,
                 out_norm_w, table: cute.Tensor, ranks: cute.Tensor, out: cute.Tensor,
                 new_prefix: cute.Tensor):
        self.kernel(x, w, vectors(prefix), vectors(blocks), vectors(res_norm_w),
                    vectors(res_proj_w),
                    vectors(out_norm_w) if cutlass.const_expr(out_norm_w is not None) else None,
                    table, ranks, out, new_prefix).launch(
            grid=self.grid, block=[producer.WARPS * WARP, 1, 1], cluster=[CLUSTER, 1, 1],
            smem=self.smem_bytes, stream=stream, min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1)  # -1: the default carveout (and no device query)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, prefix: cute.Tensor, blocks: cute.Tensor,
               res_norm_w: cute.Tensor, res_proj_w: cute.Tensor, out_norm_w,
               table: cute.Tensor, ranks: cute.Tensor, out: cute.Tensor,
               new_prefix: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, cluster, _ = cute.arch.block_idx()
        b, k = self.batch, self.k
        producing = self.ranks * PRODUCER_CLUSTERS
        if cluster < producing:  # 1. producer: every thread (the GEMM has CTA barriers)
            i = cluster // PRODUCER_CLUSTERS
            block = (cluster - i * PRODUCER_CLUSTERS) * CLUSTER + cta
            x_i = cute.make_tensor(x.iterator + i * (b * k), cute.make_layout((b, k),
                                                                              stride=(k, 1)))
            w_i = cute.make_tensor(w.iterator + i * (HIDDEN * k),
                                   cute.make_layout((HIDDEN, k), stride=(k, 1)))
            rank_i = cute.make_tensor(ranks.iterator + i, cute.make_layout(1))
            self.producer.rows(tidx, block, x_i, w_i, table, rank_i, None)
        else:  # 2. consumer: THREADS threads per CTA; the other warps exit here
            item = cluster - producing
            i = item // b
            row = item - i * b
            if tidx < THREADS:
                rows = cute.make_layout((b, HIDDEN), stride=(HIDDEN, 1))
                out_i = cute.make_tensor(out.iterator + i * (b * HIDDEN), rows)
                prefix_i = cute.make_tensor(new_prefix.iterator + i * (b * HIDDEN), rows)
                rank_i = cute.make_tensor(ranks.iterator + i, cute.make_layout(1))
                self.consumer.row(tidx, cta, row, prefix, None, blocks, None, None, res_norm_w,
                                  res_proj_w, out_norm_w, None, None, table, rank_i,
                                  vectors(out_i), vectors(prefix_i), None, None)


@functools.cache
def fused_kernel(ranks, batch, k, publish, variant):
    return OprojAttnResFused(ranks, batch, k, publish, variant)
