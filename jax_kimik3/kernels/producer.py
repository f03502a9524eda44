"""The o_proj producer (sm_90a): R ranks' rows bf16(x @ w.T), ending in the Lamport publish.

x [R, B, K] bf16 (B <= 64, read at run time; compiled per B tile count), w [R, N, K] bf16 with
N = 7168: weight streaming, so the kernel's job is to read w once at read bandwidth, and x
as little as it can. Work comes in items: 16 rows of one rank's w (N/16 = 448 per rank).
- A persistent grid of at most SMS CTAs of WARPS warps, one per SM; CTA c takes a contiguous
  run of items (so its items share a rank, and x, as far as they can).
- The weight streams through a ring of `stages` shared-memory stages, each 16 rows by `chunk`
  columns of k: one thread fills a stage with 16 bulk copies (`cp.async.bulk`, L2 evict-first)
  counted on the stage's mbarrier, `stages` chunks ahead of the warps, across item boundaries,
  so the weight keeps flowing while the warps compute and publish.
- x is staged whole ([B, K], once per rank a CTA meets) where it fits beside the ring; else
  the warps read it from global memory through L1.
- Each warp takes 1/WARPS of a chunk's k and runs `mma.sync.m16n8k16` with the 16 rows as A
  and x as B, one 8-column B tile per 8 tokens. Any bijection of k is a valid reduction order
  as long as A and B use the same one: lane (g, t) (g = lane / 4, t = lane % 4) loads 16
  contiguous bytes of rows g and g + 8 of the stage and of token row g of x at k = 8t, and
  feeds the first 8 bytes of each to one mma and the last 8 to the next. A staged row is
  followed by PAD bytes, so the rows g and g + 1 that one quarter-warp reads fall in opposite
  halves of the banks: the 16-byte loads are free of bank conflicts.
- At an item's end a lane's accumulator (row g [+8], token 8j + 2t [+1]) goes to shared
  memory; the warps' partial sums are added in warp order (deterministic), rounded to bf16,
  and leave as 16-byte vectors: into a plain [B, N] output, or published into the mailbox
  (lamport.publish_words) at the buffer of the rank's call, read from its control words at
  the item's start (hidden by the stream); nothing is published on a failed mailbox.
Token rows past B read row B - 1 (no branch in the loop) and are never stored.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels import bulk
from jax_kimik3.kernels.geometry import PRODUCER_SMEM, PRODUCER_WARPS as WARPS
from jax_kimik3.kernels.geometry import ROWS, SMS, TOKENS, VECTOR, VECTOR_BYTES, WARP
from jax_kimik3.kernels.lamport import publish_words
from jax_kimik3.kernels.primitives import (call_of, f32_to_words, fence_system, load_words,
                                           mma_bf16, store_words, without_negative_zero)
from jax_kimik3.kernels.variants import Publish

STEP = 4 * VECTOR  # k per warp step: 4 lanes x 16 bytes, two mma k-blocks
MAX_BATCH = KIMI_K3.mailbox_capacity  # decode rows per rank: at most 8 B tiles of accumulators
PAD = 64  # bytes after each staged row: its stride is 64 mod 128 bytes
CHUNKS = (1024, 768, 512, 256)  # k per stage, largest first (each a multiple of WARPS·STEP)
GOOD_STAGES, MIN_STAGES, MAX_STAGES = 4, 2, 8  # ring depths: wanted, least, most
BARRIER_BYTES = 8


def _align(n: int, to: int = 128) -> int:
    return -(-n // to) * to


class OprojProducer:
    """bf16(x @ w.T) for R ranks at (K, N) and any B of `tiles` B tiles (B read at run time);
    rows out ([B, N], R = 1) or published. `smem`: the shared memory it may take per CTA (the
    fused tail gives it less)."""

    def __init__(self, tiles: int, k: int, n: int, publish: Publish | None, ranks: int = 1,
                 smem: int = PRODUCER_SMEM):
        if k % (WARPS * STEP) or n % ROWS or not 1 <= tiles <= MAX_BATCH // TOKENS:
            raise ValueError(f"o_proj producer: K={k} must be a multiple of {WARPS * STEP}, "
                             f"N={n} of {ROWS}, and tiles={tiles} in [1, {MAX_BATCH // TOKENS}]")
        if publish is None and ranks != 1:
            raise ValueError(f"o_proj producer: ranks={ranks} without a publish; one rank "
                             "writes a plain output")
        self.tiles, self.k, self.n, self.publish, self.ranks = tiles, k, n, publish, ranks
        self.x_row = 2 * k + PAD  # bytes per staged x row
        self.x_staged, self.chunk, self.stages = self._plan(smem)
        if self.smem_bytes > smem:
            raise ValueError(f"o_proj producer: {self.smem_bytes} bytes of shared memory "
                             f"exceed smem={smem}")

    def _plan(self, smem: int):
        """(x staged, chunk, stages): x staged if the ring still gets GOOD_STAGES stages, the
        largest chunk that does; else the largest chunk with MIN_STAGES (x from global)."""
        for least in (GOOD_STAGES, MIN_STAGES):
            for staged in (True, False):
                for chunk in CHUNKS:
                    if self.k % chunk:
                        continue
                    free = smem - self._fixed_bytes(staged) - 128
                    stages = min(MAX_STAGES, free // self._stage_bytes(chunk))
                    if stages >= least:
                        return staged, chunk, stages
        raise ValueError(f"o_proj producer: smem={smem} bytes hold no ring of {MIN_STAGES} "
                         f"stages at K={self.k}, tiles={self.tiles}")

    @staticmethod
    def _stage_bytes(chunk: int) -> int:
        return ROWS * (2 * chunk + PAD)

    def _x_bytes(self, staged: bool) -> int:
        return _align(self.tiles * TOKENS * self.x_row) if staged else 0

    def _fixed_bytes(self, staged: bool) -> int:
        """All but the ring: the mbarriers, staged x, each warp's accumulators and the CTA's
        [tiles·8, 16] fp32 tile."""
        epilogue = 4 * (WARPS + 1) * self.tiles * TOKENS * ROWS
        return (_align(BARRIER_BYTES * (MAX_STAGES + 1)) + self._x_bytes(staged)
                + _align(epilogue) + 128)

    @property
    def smem_bytes(self) -> int:
        return (self._fixed_bytes(self.x_staged) + self.stages * self._stage_bytes(self.chunk)
                + 128)

    @property
    def ctas_per_rank(self) -> int:
        """Items per rank: 16 rows each."""
        return self.n // ROWS

    @property
    def grid(self) -> int:
        return min(self.ranks * self.ctas_per_rank, SMS)

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
        """The plain product: x [B, K], w [N, K] → out [B, N]."""
        self.kernel(x, w, None, None, out, cute.size(x, mode=[0])).launch(
            grid=[self.grid, 1, 1], block=[WARPS * WARP, 1, 1], smem=self.smem_bytes,
            stream=stream)

    @cute.jit
    def launch(self, stream, x: cute.Tensor, w: cute.Tensor, table: cute.Tensor,
               ranks: cute.Tensor):
        """The publishing producer of every rank of `ranks` (x [R·B, K], w [R·N, K])."""
        self.kernel(x, w, table, ranks, None, cute.size(x, mode=[0]) // self.ranks).launch(
            grid=[self.grid, 1, 1], block=[WARPS * WARP, 1, 1], smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, table, ranks, out, batch: Int32):
        if cutlass.const_expr(self.publish is not None):
            fence_system()  # release: the earlier kernels' re-arms before the publish
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        items = self.ranks * self.ctas_per_rank
        self.stream(tidx, block * items // self.grid, (block + 1) * items // self.grid, x, w,
                    table, ranks, out, batch)

    @cute.jit
    def stream(self, tidx, first, last, x: cute.Tensor, w: cute.Tensor, table, ranks, out,
               batch):
        """Items first, ..., last - 1 of the stacked x [R·B, K], w [R·N, K] (item q: rows
        16·(q mod N/16) of rank q // (N/16)), each stored into `out` [B, N] or published as
        rank ranks[i] of the mailbox. Every thread of the CTA's WARPS warps calls it (it has
        CTA barriers); the fused tail kernel too."""
        smem = cutlass.memory.SmemAllocator()
        barriers = bulk.shared_address(smem.allocate_array(
            Int64, MAX_STAGES + 1, byte_alignment=128))
        ring = bulk.shared_address(smem.allocate_array(
            Uint8, self.stages * self._stage_bytes(self.chunk), byte_alignment=128))
        staged_x = 0
        if cutlass.const_expr(self.x_staged):
            staged_x = bulk.shared_address(smem.allocate_array(
                Uint8, self._x_bytes(True), byte_alignment=128))
        partial = smem.allocate_tensor(Float32, cute.make_layout(
            (WARPS, 4 * self.tiles, WARP), stride=(4 * self.tiles * WARP, WARP, 1)),
            byte_alignment=16)
        tile = smem.allocate_tensor(Float32, cute.make_layout(
            (self.tiles * TOKENS, ROWS), stride=(ROWS, 1)), byte_alignment=16)
        x_barrier = barriers + BARRIER_BYTES * self.stages
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages + 1):
                bulk.init_barrier(barriers + BARRIER_BYTES * s)
            bulk.fence_barrier_init()
        cute.arch.barrier()
        chunks = self.k // self.chunk
        count = (last - first) * chunks  # this CTA's chunks, in order
        policy = bulk.evict_first()
        if tidx == 0:
            for c in cutlass.range(cutlass.min(count, self.stages)):
                self.fill(c, first, w, ring, barriers, policy)
        acc = cute.make_rmem_tensor(4 * self.tiles, Float32)
        x_rank, x_phase = Int32(-1), Int32(0)
        for item in cutlass.range(first, last):
            i = item // self.ctas_per_rank
            if cutlass.const_expr(self.x_staged):
                if i != x_rank:  # stage rank i's x [B, K] once every warp is done with the last
                    cute.arch.barrier()
                    if tidx == 0:
                        bulk.fence_async_shared()
                        bulk.expect_bytes(x_barrier, batch * (2 * self.k))
                        for r in cutlass.range(batch):
                            bulk.copy_in(staged_x + r * self.x_row,
                                         Int64(x.iterator.toint()) + (Int64(i) * batch + r)
                                         * (2 * self.k), 2 * self.k, x_barrier, policy)
                    bulk.wait_phase(x_barrier, x_phase)
                    x_phase, x_rank = 1 - x_phase, i
            rank = None
            wait = None
            if cutlass.const_expr(self.publish is not None):  # read now: hidden by the stream
                rank = ranks[i]
                wait = call_of(table, rank, self.publish.spec.layout,
                               self.publish.spec.timeout_ns)
            acc.fill(0.0)
            for j in cutlass.range(chunks):
                c = (item - first) * chunks + j
                s = c % self.stages
                bulk.wait_phase(barriers + BARRIER_BYTES * s, (c // self.stages) % 2)
                self.multiply(acc, ring + s * self._stage_bytes(self.chunk), staged_x, x, i, j,
                              batch)
                cute.arch.barrier()  # every warp is done with stage s
                if tidx == 0:
                    if c + self.stages < count:
                        bulk.fence_async_shared()
                        self.fill(c + self.stages, first, w, ring, barriers, policy)
            self.finish(tidx, item - i * self.ctas_per_rank, acc, partial, tile, out, wait,
                        rank, batch)

    @cute.jit
    def fill(self, c, first, w: cute.Tensor, ring, barriers, policy):
        """Issue chunk c of the CTA's chunks into its stage: 16 rows of `chunk` k, one bulk
        copy each, counted on the stage's mbarrier."""
        chunks = self.k // self.chunk
        item = first + c // chunks
        j = c % chunks
        s = c % self.stages
        barrier = barriers + BARRIER_BYTES * s
        stage = ring + s * self._stage_bytes(self.chunk)
        row_bytes = 2 * self.chunk
        bulk.expect_bytes(barrier, ROWS * row_bytes)
        i = item // self.ctas_per_rank
        first_row = Int64(i) * self.n + (item - i * self.ctas_per_rank) * ROWS
        source = (Int64(w.iterator.toint()) + first_row * (2 * self.k) + j * row_bytes)
        for r in cutlass.range_constexpr(ROWS):
            bulk.copy_in(stage + r * (row_bytes + PAD), source + r * (2 * self.k), row_bytes,
                         barrier, policy)

    @cute.jit
    def multiply(self, acc, stage, staged_x, x: cute.Tensor, i, j, batch):
        """acc += this warp's share of one chunk: the stage's 16 rows times x's tokens at the
        chunk's k (rank i's x, staged or from global)."""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        per_warp = self.chunk // WARPS
        row_bytes = 2 * self.chunk + PAD
        x_rows = [cutlass.min(m * TOKENS + g, batch - 1) for m in range(self.tiles)]
        for step in cutlass.range_constexpr(per_warp // STEP):
            kk = warp * per_warp + step * STEP + t * VECTOR  # k within the chunk
            a = bulk.load_shared(stage + g * row_bytes + kk * 2)  # row g
            b = bulk.load_shared(stage + (g + 8) * row_bytes + kk * 2)  # row g + 8
            k_at = j * self.chunk + kk
            for m in cutlass.range_constexpr(self.tiles):
                if cutlass.const_expr(self.x_staged):
                    xs = bulk.load_shared(staged_x + x_rows[m] * self.x_row + k_at * 2)
                else:  # through L1: every CTA reads x
                    xs = load_words(Int64(x.iterator.toint())
                                    + (Int64(i) * batch + x_rows[m]) * (2 * self.k)
                                    + Int64(k_at) * 2)
                for half in cutlass.range_constexpr(2):
                    d = mma_bf16([a[2 * half], b[2 * half], a[2 * half + 1], b[2 * half + 1]],
                                 [xs[2 * half], xs[2 * half + 1]],
                                 [acc[4 * m + e] for e in range(4)])
                    for e in cutlass.range_constexpr(4):
                        acc[4 * m + e] = d[e]

    @cute.jit
    def finish(self, tidx, block, acc, partial: cute.Tensor, tile: cute.Tensor, out, wait,
               rank, batch):
        """Item `block`'s rows: the warps' accumulators summed in warp order, rounded to bf16,
        stored into `out` [B, N] or published as rank `rank`."""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        tiles = self.tiles
        for e in cutlass.range_constexpr(4 * tiles):
            partial[warp, e, lane] = acc[e]
        cute.arch.barrier()
        # Element (m, e) of lane (g, t) is row g + 8·(e // 2), token 8m + 2t + e % 2.
        for entry in cutlass.range(tidx, 4 * tiles * WARP, WARPS * WARP):
            e, l = entry // WARP, entry % WARP
            total = partial[0, e, l]
            for q in cutlass.range_constexpr(1, WARPS):
                total = total + partial[q, e, l]
            m, i = e // 4, e % 4
            tile[m * TOKENS + 2 * (l % 4) + i % 2, l // 4 + 8 * (i // 2)] = total
        cute.arch.barrier()
        if tidx < 2 * batch:  # two 8-row vectors per token
            token, half = tidx // 2, tidx % 2
            words = f32_to_words([tile[token, half * VECTOR + e] for e in range(VECTOR)])
            vec = block * (ROWS // VECTOR) + half
            if cutlass.const_expr(self.publish is None):
                store_words(Int64(out.iterator.toint()) + Int64(token) * (self.n * 2)
                            + Int64(vec) * VECTOR_BYTES, words)
            else:
                publish_words(without_negative_zero(words), wait, rank, token, vec,
                              two_shot=self.publish.two_shot,
                              multicast=self.publish.spec.multicast)


@functools.cache
def producer_kernel(tiles, k, n):
    """The plain product bf16(x @ w.T) [B, N] (no mailbox), for B of `tiles` B tiles."""
    return OprojProducer(tiles, k, n, None)
