"""The o_proj producer (sm_90a): R ranks' rows bf16(x @ w.T), ending in the Lamport publish.

x [R, B, K] bf16 (B <= 64, read at run time; compiled per B tile count), w [R, N, K] bf16 with
N = 7168: weight streaming, so the kernel's job is to read w once at read bandwidth. w's rows
are the GEMM's M and x's tokens its N (one 8-column B tile per 8 tokens), in one of two forms:
- staged (`is_staged`: geometry.STAGED_TILES): one CTA owns 4 groups of 16 rows (112 CTAs per
  rank) and copies (cp.async) each 128-wide k chunk of its rows of w and of x into one of
  STAGED_STAGES (5) shared buffers while it multiplies an earlier chunk: warpgroup p runs
  `wgmma.m64nNk16` (N = 8 per B tile) over k half p of the chunk, both operands read from
  shared memory (K-major, 128-byte swizzled rows), so its warp q holds group q's products.
  Every x element crosses L2 once per 64 rows of w, and the copies in flight, not registers,
  hide the memory latency;
- streamed (one B tile at K <= 1536, and the fused tail's producer): one CTA owns 16 rows
  (448 CTAs per rank); each warp streams w into registers over K / 8, reads x through L1 and
  runs `mma.sync.m16n8k16`. Any bijection of k is a valid reduction order, as long as A and B
  use the same one, so lane (g, t) (g = lane / 4, t = lane % 4) takes 16 contiguous bytes of
  rows g and g + 8 of w and of token row g of x at k = 8t, and feeds the first 8 bytes of
  each to one mma and the last 8 to the next: every load is a full 16-byte vector, 64
  contiguous bytes per row per 4 lanes. The launch has a register budget (.minnctapersm,
  geometry.PRODUCER_BUDGETS) by K, one for the plain product (more weight loads in flight)
  and one for the one-shot publish (room beside it for the tail's next kernel), none where
  it publishes two-shot;
- a lane's accumulators (row g [+8], token 8j + 2t [+1]) go to shared memory; the k parts'
  partial sums are added in part order (deterministic), rounded to bf16, and leave as 16-byte
  vectors: into a plain [B, N] output, or published into the mailbox (lamport.publish_words)
  at the buffer of the rank's call, read from its control words before the GEMM (so the read
  hides under the weight stream); nothing is published on a failed mailbox. A publishing
  producer lets the call's next kernel launch at once (`griddepcontrol.launch_dependents`,
  kernels/tail.py); only its threads that publish run the release fence.
Token rows past B read row B - 1 (no branch in the loop) and are never stored.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels.geometry import PRODUCER_WARPS as WARPS
from jax_kimik3.kernels.geometry import (PRODUCER_BUDGETS, ROWS, STAGED_CHUNK, STAGED_GROUPS,
                                         STAGED_STAGES, STAGED_TILES, SWIZZLED_ROW_BYTES,
                                         TOKENS, VECTOR, VECTOR_BYTES, WARP)
from jax_kimik3.kernels.lamport import publish_words
from jax_kimik3.kernels.primitives import (call_of, commit_copies, copy_to_shared, f32_to_words,
                                           fence_async_shared, fence_system, let_next_launch,
                                           load_words, mma_bf16, store_words, stream_words,
                                           wait_for_copies, warpgroup_commit, warpgroup_fence,
                                           warpgroup_wait, wgmma_bf16, without_negative_zero)
from jax_kimik3.kernels.variants import Publish

STEP = 4 * VECTOR  # k per warp step: 4 lanes x 16 bytes, two mma k-blocks
UNROLL = 6  # warp steps in flight
MMA_K = 16  # k of one mma
MAX_BATCH = KIMI_K3.mailbox_capacity  # decode rows per rank: at most 8 B tiles of accumulators


class OprojProducer:
    """bf16(x @ w.T) for R ranks at (K, N) and any B of `tiles` B tiles (B read at run time);
    rows out ([B, N], R = 1) or published."""

    def __init__(self, tiles: int, k: int, n: int, publish: Publish | None, ranks: int = 1,
                 staged: bool = False):
        groups = STAGED_GROUPS if staged else 1
        chunk = STAGED_CHUNK if staged else WARPS * STEP
        if k % chunk or n % (ROWS * groups) or not 1 <= tiles <= MAX_BATCH // TOKENS:
            raise ValueError(f"o_proj producer: K={k} must be a multiple of {chunk}, "
                             f"N={n} of {ROWS * groups}, and tiles={tiles} in "
                             f"[1, {MAX_BATCH // TOKENS}]")
        if publish is None and ranks != 1:
            raise ValueError(f"o_proj producer: ranks={ranks} without a publish; one rank "
                             "writes a plain output")
        self.tiles, self.k, self.n, self.publish, self.ranks = tiles, k, n, publish, ranks
        self.staged = staged  # operands through shared memory
        self.groups = groups  # 16-row groups of w per CTA
        self.kparts = WARPS // groups  # warps over one group's rows, each over part of k

    @property
    def smem_bytes(self) -> int:
        """Staged: the chunk buffers; then each k part's accumulators and the CTA's
        [tiles·8, 16·groups] fp32 tile."""
        values = 4 * self.tiles * self.groups
        tile = 4 * (self.kparts + 1) * values * WARP + 64
        if not self.staged:
            return tile
        return STAGED_STAGES * 2 * self.half_bytes + tile + 1024  # 1024: the buffers' alignment

    @property
    def half_bytes(self) -> int:
        """Bytes of one 64-wide k half of a staged chunk: every row's 128-byte swizzled row."""
        return self.stage_rows * SWIZZLED_ROW_BYTES

    @property
    def stage_rows(self) -> int:
        """Rows of one staged chunk: the CTA's rows of w, then x's tokens."""
        return ROWS * self.groups + TOKENS * self.tiles

    @property
    def launch_config(self) -> dict:
        """Block, shared memory and, streamed at one B tile unless it publishes two-shot, the
        register budget (PRODUCER_BUDGETS) of the plain product or of the one-shot publish."""
        config = dict(block=[WARPS * WARP, 1, 1], smem=self.smem_bytes,
                      preferred_smem_carveout=-1)  # -1: the default carveout (no device query)
        plain, one_shot = PRODUCER_BUDGETS.get(self.k, (None, None))
        budget = plain if self.publish is None else one_shot
        if (not self.staged and self.tiles == 1 and budget is not None
                and not (self.publish is not None and self.publish.two_shot)):
            config.update(min_blocks_per_mp=budget)
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
        in-order sum of its k parts, and the store into `out` [B, N] or the publish as rank
        `rank` of the mailbox. Every thread of the CTA's WARPS warps calls it (it has CTA
        barriers); the fused tail kernel too."""
        wait = None
        if cutlass.const_expr(self.publish is not None):  # read now: hidden by the GEMM
            wait = call_of(table, rank, self.publish.spec.layout, self.publish.spec.timeout_ns)
        smem = cutlass.memory.SmemAllocator()
        warp = cute.arch.warp_idx()
        values = 4 * self.tiles * self.groups
        partial = smem.allocate_tensor(
            Float32, cute.make_layout((self.kparts, values, WARP),
                                      stride=(values * WARP, WARP, 1)), byte_alignment=16)
        q, part = warp % self.groups, warp // self.groups  # this warp's group and k part
        if cutlass.const_expr(self.staged):
            acc = self.staged_products(smem, tidx, block, part, x, w, batch)
        else:
            acc = self.streamed_products(block, x, w, batch)
        for e in cutlass.range_constexpr(4 * self.tiles):
            partial[part, 4 * self.tiles * q + e, cute.arch.lane_idx()] = acc[e]
        self.finish(smem, partial, tidx, block, wait, rank, out, batch)

    @cute.jit
    def streamed_products(self, block, x: cute.Tensor, w: cute.Tensor, batch):
        """This warp's fp32 products [tile, 4] of the CTA's 16 rows over its K / WARPS: w
        streamed into registers, x loaded through L1."""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        tiles, k = self.tiles, self.k
        k0 = warp * (k // WARPS) + t * VECTOR  # this lane's first k
        w_at = Int64(w.iterator.toint()) + (Int64(block * ROWS + g) * k + k0) * 2
        x_at = Int64(x.iterator.toint()) + Int64(k0) * 2
        x_rows = [Int64(cutlass.min(j * TOKENS + g, batch - 1)) * (k * 2)
                  for j in range(tiles)]
        acc = cute.make_rmem_tensor(4 * tiles, Float32)  # [tile, 4]
        acc.fill(0.0)
        for step in cutlass.range(k // (WARPS * STEP), unroll=UNROLL):
            offset = Int64(step * STEP * 2)
            a = stream_words(w_at + offset)  # row g
            b = stream_words(w_at + offset + Int64(8 * k * 2))  # row g + 8
            for j in cutlass.range_constexpr(tiles):
                xs = load_words(x_at + x_rows[j] + offset)  # through L1: every CTA reads x
                multiply(acc, 4 * j, a, b, xs)
        return acc

    @cute.jit
    def staged_products(self, smem, tidx, block, part, x: cute.Tensor, w: cute.Tensor,
                        batch):
        """This warp's fp32 products [tile, 4] of its group (warp % 4) over k half `part` of
        every chunk: the CTA copies chunk c + STAGES - 1 of its w rows and of x into shared
        memory while each warpgroup multiplies its half of chunk c. A buffer holds a chunk's
        two 64-wide k halves, each its rows (w's, then x's) K-major in 128-byte swizzled rows
        (geometry.SWIZZLED_ROW_BYTES)."""
        tiles, k, groups = self.tiles, self.k, self.groups
        half_bytes = self.half_bytes
        stage_bytes = 2 * half_bytes
        base = Int32(smem.allocate(STAGED_STAGES * stage_bytes, byte_alignment=1024).toint())
        rows = ROWS * groups
        w_at = Int64(w.iterator.toint()) + Int64(block * rows) * (k * 2)
        x_at = Int64(x.iterator.toint())

        chunks = k // STAGED_CHUNK
        for c in cutlass.range_constexpr(STAGED_STAGES - 1):
            if c < chunks:
                self.copy_chunk(tidx, c, base + c * stage_bytes, w_at, x_at, batch)
            commit_copies()

        acc = cute.make_rmem_tensor(4 * tiles, Float32)  # [tile, 4]
        acc.fill(0.0)
        for c in cutlass.range(chunks):
            wait_for_copies(STAGED_STAGES - 2)
            fence_async_shared()  # this thread's copies of chunk c, before wgmma reads them
            cute.arch.barrier()  # chunk c has landed; every wgmma of chunk c - 1 is done
            if c + STAGED_STAGES - 1 < chunks:
                self.copy_chunk(tidx, c + STAGED_STAGES - 1,
                                base + ((c + STAGED_STAGES - 1) % STAGED_STAGES) * stage_bytes,
                                w_at, x_at, batch)
            commit_copies()
            half = base + (c % STAGED_STAGES) * stage_bytes + part * half_bytes
            values = [acc[e] for e in range(4 * tiles)]
            warpgroup_fence()
            for step in cutlass.range_constexpr(STAGED_CHUNK // (2 * MMA_K)):
                at = half + step * (MMA_K * 2)  # k advances inside the swizzled rows
                values = wgmma_bf16(at, at + rows * SWIZZLED_ROW_BYTES, values)
            warpgroup_commit()
            warpgroup_wait(0)
            for e in cutlass.range_constexpr(4 * tiles):
                acc[e] = values[e]
        wait_for_copies(0)
        return acc

    @cute.jit
    def copy_chunk(self, tidx, chunk, stage, w_at: Int64, x_at: Int64, batch):
        """This thread's copies of k chunk `chunk` of the CTA's w rows (from `w_at`) and of x
        (token rows past B read row B - 1) into the buffer at shared address `stage`."""
        units = STAGED_CHUNK // VECTOR
        per_row = SWIZZLED_ROW_BYTES // VECTOR_BYTES  # 16-byte units of a swizzled row
        items = self.stage_rows * units
        rows = ROWS * self.groups
        for i in cutlass.range_constexpr((items + WARPS * WARP - 1) // (WARPS * WARP)):
            item = tidx + i * WARPS * WARP
            if item < items:
                r, u = item // units, item % units
                at = w_at + Int64(r) * (self.k * 2)
                if r >= rows:
                    at = x_at + Int64(cutlass.min(r - rows, batch - 1)) * (self.k * 2)
                copy_to_shared(stage + (u // per_row) * self.half_bytes
                               + r * SWIZZLED_ROW_BYTES
                               + ((u % per_row) ^ (r % per_row)) * VECTOR_BYTES,
                               at + Int64(chunk * STAGED_CHUNK + u * VECTOR) * 2)

    @cute.jit
    def finish(self, smem, partial: cute.Tensor, tidx, block, wait, rank, out, batch):
        """The k parts' sums in part order (deterministic), rounded to bf16, out as 16-byte
        vectors: into `out` [B, N], or published into the mailbox (lamport.publish_words) at
        the call's buffer (`wait`); nothing is published on a failed mailbox."""
        tiles, groups = self.tiles, self.groups
        values = 4 * tiles * groups
        tile = smem.allocate_tensor(Float32, cute.make_layout((tiles * TOKENS, ROWS * groups),
                                                              stride=(ROWS * groups, 1)),
                                    byte_alignment=16)
        cute.arch.barrier()
        # Element (q, j, i) of lane (g, t) is row 16q + g + 8·(i // 2), token 8j + 2t + i % 2.
        for item in cutlass.range(tidx, values * WARP, WARPS * WARP):
            e, l = item // WARP, item % WARP
            total = partial[0, e, l]
            for p in cutlass.range_constexpr(1, self.kparts):
                total = total + partial[p, e, l]
            group, j, i = e // (4 * tiles), (e // 4) % tiles, e % 4
            tile[j * TOKENS + 2 * (l % 4) + i % 2,
                 ROWS * group + l // 4 + 8 * (i // 2)] = total
        cute.arch.barrier()
        per_token = 2 * groups  # 8-row vectors per token
        for item in cutlass.range(tidx, per_token * batch, WARPS * WARP):
            token, part = item // per_token, item % per_token
            words = f32_to_words([tile[token, part * VECTOR + e] for e in range(VECTOR)])
            vec = block * per_token + part
            if cutlass.const_expr(self.publish is None):
                store_words(Int64(out.iterator.toint()) + Int64(token) * (self.n * 2)
                            + Int64(vec) * VECTOR_BYTES, words)
            else:
                publish_words(without_negative_zero(words), wait, rank, token, vec,
                              two_shot=self.publish.two_shot,
                              multicast=self.publish.spec.multicast)


@cute.jit
def multiply(acc: cute.Tensor, e: cutlass.Constexpr, a, b, xs):
    """acc[e : e + 4] += one 16-row group (a: row g, b: row g + 8; 16 bytes each) times one
    token row (xs) over this lane's 8 k: two mma k-blocks. Any bijection of k is a valid
    reduction order as long as A and B use the same one: words 0-1 of each feed the first
    mma, 2-3 the second."""
    for half in cutlass.range_constexpr(2):
        d = mma_bf16([a[2 * half], b[2 * half], a[2 * half + 1], b[2 * half + 1]],
                     [xs[2 * half], xs[2 * half + 1]], [acc[e + i] for i in range(4)])
        for i in cutlass.range_constexpr(4):
            acc[e + i] = d[i]


def is_staged(tiles: int, k: int) -> bool:
    """Whether the producer of `tiles` B tiles at K = `k` stages its operands in shared
    memory (geometry.STAGED_TILES)."""
    return tiles >= STAGED_TILES.get(k, 1)


@functools.cache
def producer_kernel(tiles, k, n):
    """The plain product bf16(x @ w.T) [B, N] (no mailbox), for B of `tiles` B tiles."""
    return OprojProducer(tiles, k, n, None, staged=is_staged(tiles, k))
