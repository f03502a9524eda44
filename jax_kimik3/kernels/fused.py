"""The fused post-attention tail (sm_90a): o_proj producer and AttnRes consumer work of R ranks
in one persistent launch ("fused" in kernels/oproj.py, which has the algorithm and launches it).

The grid is `clusters` clusters of CLUSTER CTAs, every one resident at once (`residency`
sizes it from the device's occupancy), each CTA of PRODUCER_WARPS warps:
1. producer items: CTA j of the grid takes CTA items j, j + CLUSTER·clusters, ... of the R·N/16
   producer CTAs (`OprojProducer.rows`: 16 rows of rank i's w, then the publish);
2. consumer items: then cluster g takes token rows g, g + clusters, ... of the R·B rows
   (`AttnResKernel.row` on the consumer's threads of each CTA; the other warps exit first).
A CTA finishes all its producer items before it polls, and every CTA is resident, so each
producer item is done by a running CTA: the consumers' waits never depend on the order in
which the hardware dispatches blocks. The last CTA advances the ranks' call counters.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from jax_kimik3.kernels import attn_res as attn_res_kernels
from jax_kimik3.kernels import producer
from jax_kimik3.kernels.attn_res import HIDDEN, AttnResTensors
from jax_kimik3.kernels.variants import AttnResVariant
from jax_kimik3.kernels.geometry import (CLUSTER, FUSED_CTAS_PER_SM, PRODUCER_WARPS, ROWS,
                                         WARP)
from jax_kimik3.kernels.primitives import arrive, fence_system, finish_call
from jax_kimik3.kernels.variants import Publish, tiles

PRODUCER_CTAS = HIDDEN // ROWS  # 448 producer items per rank
# Register cap through .minnctapersm: MIN_CTAS_PER_SM CTAs of 256 threads per SM (<= 64
# registers), which `residency` counts on. The consumer role alone would take 72 and the
# producer 40 (B <= 8; 68 at B = 64) (ptxas, sm_90a); at 64 the consumer spills a few bytes.
MIN_CTAS_PER_SM = FUSED_CTAS_PER_SM
THREADS_PER_CTA = PRODUCER_WARPS * WARP
SMEM_PER_CTA = 228 * 1024 // MIN_CTAS_PER_SM - 1024  # an sm_90 SM's shared memory, 4 CTAs


class OprojAttnResFused:
    """The fused tail for `ranks` ranks: x [R·B, K], w [R·H, K], ranks int32 [R] → out,
    new_prefix [R·B, H] (each rank's post-attention AttnRes on the all-reduce), on a grid of
    at most `clusters` co-resident clusters."""

    def __init__(self, batch: int, k: int, variant: AttnResVariant, clusters: int):
        reduction = variant.reduction
        if (reduction is None or reduction.two_shot or variant.ahead or variant.write_idx >= 0
                or variant.precomputed):
            raise ValueError(f"fused o_proj tail: {variant=} must complete a one-shot "
                             "reduction, write no block, compute its statistics and store "
                             "none ahead")
        if clusters < 1:
            raise ValueError(f"fused o_proj tail: clusters={clusters} must be >= 1")
        self.ranks, self.batch, self.k = reduction.ranks, batch, k
        self.producer = producer.OprojProducer(tiles(batch), k, HIDDEN,
                                               Publish(reduction.spec, False), self.ranks)
        self.consumer = attn_res_kernels.AttnResKernel(variant, capped=True)
        self.layout = reduction.spec.layout
        items = self.ranks * (PRODUCER_CTAS // CLUSTER + batch)  # in clusters
        self.clusters = min(clusters, items)
        if self.smem_bytes > SMEM_PER_CTA:  # `residency` counts MIN_CTAS_PER_SM per SM
            raise ValueError(f"fused o_proj tail: {self.smem_bytes} bytes of shared memory "
                             f"per CTA exceed {SMEM_PER_CTA} ({MIN_CTAS_PER_SM} CTAs per SM)")

    @property
    def smem_bytes(self) -> int:
        """Both roles' shared memory: the DSL lays out every allocation of the kernel, of
        either role, one after the other (taking the larger one overflowed: illegal address
        on the H200)."""
        return self.producer.smem_bytes + attn_res_kernels._smem_bytes(
            2, self.consumer.exchanged, self.consumer.warps)

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, w: cute.Tensor, prefix: cute.Tensor,
                 blocks: cute.Tensor, res_norm_w: cute.Tensor, res_proj_w: cute.Tensor,
                 out_norm_w, table: cute.Tensor, ranks: cute.Tensor, out: cute.Tensor,
                 new_prefix: cute.Tensor):
        consumer = AttnResTensors(prefix=prefix, blocks=blocks, res_norm_w=res_norm_w,
                                  res_proj_w=res_proj_w, out_norm_w=out_norm_w, table=table,
                                  ranks=ranks, out=out, new_prefix=new_prefix)
        self.kernel(x, w, consumer.vectors(self.consumer.vector)).launch(
            grid=[CLUSTER, self.clusters, 1], block=[THREADS_PER_CTA, 1, 1],
            cluster=[CLUSTER, 1, 1], smem=self.smem_bytes, stream=stream,
            min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1)  # -1: the default carveout (and no device query)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, t: AttnResTensors):
        """x, w: the producer's operands; `t`: the consumer's tensors (as vectors)."""
        fence_system()  # release: the earlier kernels' re-arms before the publish
        tidx, _, _ = cute.arch.thread_idx()
        cta, cluster, _ = cute.arch.block_idx()
        ctas = CLUSTER * self.clusters
        # 1. producer items: every thread (the GEMM has CTA barriers)
        for item in cutlass.range(cluster * CLUSTER + cta, self.ranks * PRODUCER_CTAS, ctas):
            i = item // PRODUCER_CTAS
            x_i, w_i = self.producer.rank_operands(x, w, i, self.batch)
            self.producer.rows(tidx, item - i * PRODUCER_CTAS, x_i, w_i, t.table, t.ranks[i],
                               None, self.batch)
        # 2. consumer rows: the consumer's threads per CTA; the other warps exit here
        if tidx < self.consumer.threads:
            for row in cutlass.range(cluster, self.ranks * self.batch, self.clusters):
                self.consumer.row(tidx, cta, row, self.batch, t)
            if tidx == 0:  # the items' barriers: every thread has read the control words
                finish_call(arrive(t.table, t.ranks, self.layout), t.table, t.ranks,
                            self.ranks, self.layout)


@functools.cache
def fused_kernel(batch, k, variant, clusters):
    return OprojAttnResFused(batch, k, variant, clusters)
