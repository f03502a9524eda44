"""The o_proj producer (sm_90a): R ranks' rows bf16(x @ w.T), ending in the Lamport publish.

x [R, B, K] bf16 (B <= 64, read at run time; compiled per B tile count), w [R, N, K] bf16 with
N = 7168: weight streaming,
so the kernel's job is to read w once at read bandwidth. One CTA owns G groups of 16 rows of
one rank's w (R·N/(16·G) CTAs; G = 1: 448 per rank); its WARPS warps split K and each runs
`mma.sync.m16n8k16` with a group's 16 rows as A and x as B, one 8-column B tile per 8 tokens:
- any bijection of k is a valid reduction order, as long as A and B use the same one, so lane
  (g, t) (g = lane / 4, t = lane % 4) loads 16 contiguous bytes of rows g and g + 8 of w and of
  token row g of x at k = 8t, and feeds the first 8 bytes of each to one mma and the last 8 to
  the next: every load is a full 16-byte vector, 64 contiguous bytes per row per 4 lanes;
- every CTA reads all of x from L2, so at many B tiles (geometry.PRODUCER_GROUPED_TILES) a
  CTA takes G = 2 groups and each x load feeds both: half the L2 traffic of x;
- a lane's accumulator (n0 + g [+8], token 8j + 2t [+1]) goes to shared memory; the warps'
  partial sums are added in warp order (deterministic), rounded to bf16, and leave as 16-byte
  vectors: into a plain [B, N] output, or published into the mailbox (lamport.publish_words)
  at the buffer of the rank's call, read from its control words before the GEMM (so the read
  hides under the weight stream); nothing is published on a failed mailbox. A publishing
  producer lets the call's next kernel launch at once (`griddepcontrol.launch_dependents`,
  kernels/tail.py); only its threads that publish run the release fence.
At the (K, B tile count) pairs of geometry.PRODUCER_BUDGETS the launch has a register budget
(.minnctapersm), one for the plain product (more weight loads in flight) and one for the
one-shot publish (room beside it for the tail's next kernel), none where it publishes
two-shot; with two groups, one that keeps every CTA in one wave.
Token rows past B read row B - 1 (no branch in the loop) and are never stored.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels.geometry import PRODUCER_WARPS as WARPS
from jax_kimik3.kernels.geometry import (PRODUCER_BUDGETS, PRODUCER_GROUPED_CTAS_PER_SM,
                                         PRODUCER_GROUPED_TILES, ROWS, TOKENS, VECTOR,
                                         VECTOR_BYTES, WARP)
from jax_kimik3.kernels.lamport import publish_words
from jax_kimik3.kernels.primitives import (call_of, f32_to_words, fence_system,
                                           let_next_launch, load_words, mma_bf16, stream_words,
                                           store_words, without_negative_zero)
from jax_kimik3.kernels.variants import Publish

STEP = 4 * VECTOR  # k per warp step: 4 lanes x 16 bytes, two mma k-blocks
UNROLL = 6  # warp steps in flight
MAX_BATCH = KIMI_K3.mailbox_capacity  # decode rows per rank: at most 8 B tiles of accumulators


class OprojProducer:
    """bf16(x @ w.T) for R ranks at (K, N) and any B of `tiles` B tiles (B read at run time);
    rows out ([B, N], R = 1) or published."""

    def __init__(self, tiles: int, k: int, n: int, publish: Publish | None, ranks: int = 1,
                 groups: int = 1):
        if k % (WARPS * STEP) or n % (ROWS * groups) or not 1 <= tiles <= MAX_BATCH // TOKENS:
            raise ValueError(f"o_proj producer: K={k} must be a multiple of {WARPS * STEP}, "
                             f"N={n} of {ROWS * groups}, and tiles={tiles} in "
                             f"[1, {MAX_BATCH // TOKENS}]")
        if publish is None and ranks != 1:
            raise ValueError(f"o_proj producer: ranks={ranks} without a publish; one rank "
                             "writes a plain output")
        self.tiles, self.k, self.n, self.publish, self.ranks = tiles, k, n, publish, ranks
        self.groups = groups  # 16-row groups of w per CTA, sharing each x load

    @property
    def smem_bytes(self) -> int:
        """Each warp's accumulators, then the CTA's [tiles·8, 16·groups] fp32 tile."""
        return 4 * (WARPS + 1) * self.tiles * TOKENS * ROWS * self.groups + 64

    @property
    def launch_config(self) -> dict:
        """Block, shared memory and, at PRODUCER_BUDGETS unless it publishes two-shot, the
        register budget of the plain product or of the one-shot publish."""
        config = dict(block=[WARPS * WARP, 1, 1], smem=self.smem_bytes)
        plain, one_shot = PRODUCER_BUDGETS.get((self.k, self.tiles), (None, None))
        two_shot = self.publish is not None and self.publish.two_shot
        budget = None if two_shot else plain if self.publish is None else one_shot
        if budget is not None:  # -1: no device query
            config.update(min_blocks_per_mp=budget, preferred_smem_carveout=-1)
        elif self.groups > 1:
            config.update(min_blocks_per_mp=PRODUCER_GROUPED_CTAS_PER_SM,
                          preferred_smem_carveout=-1)
        return config

    @property
    def ctas_per_rank(self) -> int:
        return self.n // (ROWS * self.groups)

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
        """The plain product: x [B, K], w [N, K] → out [B, N]."""
        self.kernel(x, w, None, None, out, cute.size(x, mode=[0])).launch(
            grid=[self.ctas_per_rank, 1, 1], stream=stream, **self.launch_config)

    @cute.jit
    def launch(self, stream, x: cute.Tensor, w: cute.Tensor, table: cute.Tensor,
               ranks: cute.Tensor):
        """The publishing producer of every rank of `ranks` (x [R·B, K], w [R·N, K])."""
        self.kernel(x, w, table, ranks, None, cute.size(x, mode=[0]) // self.ranks).launch(
            grid=[self.ranks * self.ctas_per_rank, 1, 1], stream=stream, **self.launch_config)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, table, ranks, out, batch: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block // self.ctas_per_rank
        if cutlass.const_expr(self.publish is not None):
            if tidx < 2 * self.groups * (cute.size(x, mode=[0]) // self.ranks):  # who publishes ...
                fence_system()  # ... release the earlier kernels' re-arms: the others need not
            let_next_launch()
        x_i, w_i = self.rank_operands(x, w, i, batch)
        self.rows(tidx, block - i * self.ctas_per_rank, x_i, w_i, table,
                  None if cutlass.const_expr(ranks is None) else ranks[i], out, batch)

    @cute.jit
    def rank_operands(self, x: cute.Tensor, w: cute.Tensor, i, batch):
        """Rank i's x [B, K] and w [N, K] inside the stacked x [R·B, K] and w [R·N, K]."""
        k, n = self.k, self.n
        x_i = cute.make_tensor(x.iterator + i * (batch * k),
                               cute.make_layout((batch, k), stride=(k, 1)))
        w_i = cute.make_tensor(w.iterator + i * (n * k), cute.make_layout((n, k), stride=(k, 1)))
        return x_i, w_i

    @cute.jit
    def rows(self, tidx, block, x: cute.Tensor, w: cute.Tensor, table, rank, out, batch):
        """CTA `block`'s 16·groups rows of one rank's w for its `batch` tokens: the GEMM, the
        in-order warp sum, and the store into `out` [B, N] or the publish as rank `rank` of
        the mailbox. Every thread of the CTA's WARPS warps calls it (it has CTA barriers);
        the fused tail kernel too."""
        wait = None
        if cutlass.const_expr(self.publish is not None):  # read now: hidden by the GEMM
            wait = call_of(table, rank, self.publish.spec.layout, self.publish.spec.timeout_ns)
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        tiles, k, groups = self.tiles, self.k, self.groups
        row0 = block * ROWS * groups
        k0 = warp * (k // WARPS) + t * VECTOR  # this lane's first k
        w_at = Int64(w.iterator.toint()) + (Int64(row0 + g) * k + k0) * 2
        x_at = Int64(x.iterator.toint()) + Int64(k0) * 2
        x_rows = [Int64(cutlass.min(j * TOKENS + g, batch - 1)) * (k * 2)
                  for j in range(tiles)]
        acc = cute.make_rmem_tensor(4 * tiles * groups, Float32)  # [group, tile, 4]
        acc.fill(0.0)
        for step in cutlass.range(k // (WARPS * STEP), unroll=UNROLL):
            offset = Int64(step * STEP * 2)
            a = [stream_words(w_at + offset + Int64(ROWS * q * k * 2))  # row 16q + g
                 for q in range(groups)]
            b = [stream_words(w_at + offset + Int64((ROWS * q + 8) * k * 2))  # row 16q + g + 8
                 for q in range(groups)]
            for j in cutlass.range_constexpr(tiles):
                xs = load_words(x_at + x_rows[j] + offset)  # through L1: every CTA reads x
                for q in cutlass.range_constexpr(groups):
                    e = 4 * (q * tiles + j)
                    for half in cutlass.range_constexpr(2):
                        d = mma_bf16([a[q][2 * half], b[q][2 * half], a[q][2 * half + 1],
                                      b[q][2 * half + 1]],
                                     [xs[2 * half], xs[2 * half + 1]],
                                     [acc[e + i] for i in range(4)])
                        for i in cutlass.range_constexpr(4):
                            acc[e + i] = d[i]

        smem = cutlass.memory.SmemAllocator()
        values = 4 * tiles * groups
        partial = smem.allocate_tensor(Float32, cute.make_layout((WARPS, values, WARP),
                                                                 stride=(values * WARP, WARP, 1)),
                                       byte_alignment=16)
        tile = smem.allocate_tensor(Float32, cute.make_layout((tiles * TOKENS, ROWS * groups),
                                                              stride=(ROWS * groups, 1)),
                                    byte_alignment=16)
        for e in cutlass.range_constexpr(values):
            partial[warp, e, lane] = acc[e]
        cute.arch.barrier()
        # Sum the warps in order; element (q, j, i) of lane (g, t) is row 16q + g + 8·(i // 2),
        # token 8j + 2t + i % 2.
        for item in cutlass.range(tidx, values * WARP, WARPS * WARP):
            e, l = item // WARP, item % WARP
            total = partial[0, e, l]
            for q in cutlass.range_constexpr(1, WARPS):
                total = total + partial[q, e, l]
            group, j, i = e // (4 * tiles), (e // 4) % tiles, e % 4
            tile[j * TOKENS + 2 * (l % 4) + i % 2,
                 ROWS * group + l // 4 + 8 * (i // 2)] = total
        cute.arch.barrier()
        per_token = 2 * groups  # 8-row vectors per token
        if tidx < per_token * batch:
            token, part = tidx // per_token, tidx % per_token
            words = f32_to_words([tile[token, part * VECTOR + e] for e in range(VECTOR)])
            vec = block * per_token + part
            if cutlass.const_expr(self.publish is None):
                store_words(Int64(out.iterator.toint()) + Int64(token) * (self.n * 2)
                            + Int64(vec) * VECTOR_BYTES, words)
            else:
                publish_words(without_negative_zero(words), wait, rank, token, vec,
                              two_shot=self.publish.two_shot,
                              multicast=self.publish.spec.multicast)


def row_groups(tiles: int) -> int:
    """16-row groups of w per producer CTA at `tiles` B tiles (two share each x load)."""
    return 2 if tiles >= PRODUCER_GROUPED_TILES else 1


@functools.cache
def producer_kernel(tiles, k, n):
    """The plain product bf16(x @ w.T) [B, N] (no mailbox), for B of `tiles` B tiles."""
    return OprojProducer(tiles, k, n, None, groups=row_groups(tiles))
