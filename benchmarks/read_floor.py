"""The read floor of a weight-sized read (sm_90a, benchmarks only): kernels that read an array
once and do nothing else, in the shapes a GEMV producer could take. What the fastest of them
costs per call in a chain is the least any kernel reading those bytes once pays here: a
read-bound kernel is held against it beside the 1 GiB read bandwidth, whose rate a read of a
few MB does not reach (launch, first-byte latency and the ramp are part of the call).

Two forms, over `data` seen as 16-byte vectors:
- `loads`: a grid of CTAs of `threads` threads; each thread issues its `per_thread` vector
  loads at once (vector j·threads + t of its CTA's run), then folds them (xor);
- `bulk`: a grid of CTAs, each copying its contiguous `slice` of the array into shared memory
  with `cp.async.bulk` copies of `chunk` bytes counted on one mbarrier (every byte it reads
  requested at its start), then waiting for them.
Each CTA c writes out[c] = carry[c] (a dependent read and write, as a chain needs), and the
folded words where they equal carry[c] (never, with random data: but the loads stay live).
"""

from __future__ import annotations

import dataclasses
import functools

import cutlass
import cutlass.cute as cute
import cutlass.memory
import jax
import jax.numpy as jnp
from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from benchmarks.timing import time_per_call
from jax_kimik3.kernels.geometry import VECTOR_BYTES, WARP
from jax_kimik3.kernels.primitives import load_words


@dsl_user_op
def copy_to_shared(destination: cute.Pointer, source: Int64, count: int, landed: cute.Pointer, *,
                   loc=None, ip=None):
    """`cp.async.bulk` of `count` bytes (a multiple of 16, both ends 16-byte aligned) from
    global `source` to shared `destination`, completing on the mbarrier `landed`."""
    llvm.inline_asm(
        None, [Int32(destination.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
               Int64(source).ir_value(loc=loc, ip=ip), Int32(count).ir_value(loc=loc, ip=ip),
               Int32(landed.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dataclasses.dataclass(frozen=True)
class ReadShape:
    """A stream-read kernel's shape: `form` "loads" (CTAs of `threads` threads, each issuing
    `per_thread` 16-byte loads at once, under a register budget of `ctas_per_sm` CTAs per SM)
    or "bulk" (CTAs of one warp, each copying `slice_bytes` in copies of `chunk` bytes)."""

    form: str
    threads: int = WARP
    per_thread: int = 0
    ctas_per_sm: int = 1
    slice_bytes: int = 0
    chunk: int = 0

    def grid(self, nbytes: int) -> int:
        """CTAs of a read of `nbytes` in this shape."""
        per_cta = (self.threads * self.per_thread * VECTOR_BYTES if self.form == "loads"
                   else self.slice_bytes)
        if nbytes % per_cta:
            raise ValueError(f"read_floor: nbytes={nbytes} is not a multiple of the "
                             f"{per_cta} bytes per CTA of {self}")
        return nbytes // per_cta


# Measured on an H200 (benchmarks/RESULTS.md, session 20): every shape tried reads 11-44 MB
# within 3% of the fastest; these three span the forms.
SHAPES = (ReadShape("loads", threads=256, per_thread=4, ctas_per_sm=8),
          ReadShape("loads", threads=256, per_thread=12, ctas_per_sm=4),
          ReadShape("bulk", slice_bytes=48 * 1024, chunk=4 * 1024))


class StreamRead:
    """out [G] u32 = carry [G] u32, after reading `data` (bf16, any shape) once in `shape`."""

    def __init__(self, shape: ReadShape):
        self.shape = shape

    @cute.jit
    def __call__(self, stream, carry: cute.Tensor, data: cute.Tensor, out: cute.Tensor):
        grid, shape = cute.size(carry, mode=[0]), self.shape
        if cutlass.const_expr(shape.form == "loads"):
            self.loads(carry, data, out).launch(grid=[grid, 1, 1], block=[shape.threads, 1, 1],
                                                min_blocks_per_mp=shape.ctas_per_sm,
                                                preferred_smem_carveout=-1, stream=stream)
        else:
            self.bulk(carry, data, out).launch(grid=[grid, 1, 1], block=[WARP, 1, 1],
                                               smem=shape.slice_bytes + 256, stream=stream)

    @cute.kernel
    def loads(self, carry: cute.Tensor, data: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        threads, per_thread = self.shape.threads, self.shape.per_thread
        base = data.iterator.toint() + Int64(VECTOR_BYTES) * (
            Int64(cta) * (threads * per_thread) + Int64(tidx))
        words = []
        for j in cutlass.range_constexpr(per_thread):
            words.extend(load_words(base + VECTOR_BYTES * threads * j))
        self.finish(tidx, cta, words, carry, out)

    @cute.kernel
    def bulk(self, carry: cute.Tensor, data: cute.Tensor, out: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        slice_bytes, chunk = self.shape.slice_bytes, self.shape.chunk
        smem = cutlass.memory.SmemAllocator()
        landed = smem.allocate_array(Int64, 1)
        stage = smem.allocate_array(Uint32, slice_bytes // 4, byte_alignment=128)
        if lane == 0:
            cute.arch.mbarrier_init(landed, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(landed, slice_bytes)
        cute.arch.sync_warp()
        source = data.iterator.toint() + Int64(cta) * slice_bytes
        copies = slice_bytes // chunk
        for j in cutlass.range_constexpr((copies + WARP - 1) // WARP):
            c = lane + j * WARP
            if c < copies:
                copy_to_shared(stage + c * (chunk // 4), source + Int64(c) * chunk, chunk,
                               landed)
        cute.arch.mbarrier_wait(landed, 0)
        landed_words = cute.make_tensor(stage, cute.make_layout(slice_bytes // 4))
        self.finish(lane, cta, [landed_words[lane]], carry, out)

    @cute.jit
    def finish(self, tidx, cta, words: list, carry: cute.Tensor, out: cute.Tensor):
        """out[cta] = carry[cta], and the xor of `words` where it equals carry[cta]."""
        fold = words[0]
        for w in words[1:]:
            fold = fold ^ w
        seen = carry[cta]
        if tidx == 0:
            out[cta] = seen
        if fold == seen:
            out[cta] = fold


@functools.cache
def _kernel(shape: ReadShape) -> StreamRead:
    return StreamRead(shape)


def stream_read(carry, data, shape: ReadShape):
    """carry [G] u32 back (G = shape.grid(data's bytes)), after a kernel of `shape` read `data`
    once."""
    from cutlass.jax import cutlass_call

    grid = shape.grid(data.size * data.dtype.itemsize)
    if carry.shape != (grid,):
        raise ValueError(f"read_floor: carry.shape={carry.shape}, expected ({grid},) for {shape}")
    return cutlass_call(_kernel(shape), output_shape_dtype=jax.ShapeDtypeStruct(
        carry.shape, jnp.uint32))(carry, data)


def read_floor_us(arrays) -> float:
    """Per-call µs of the fastest of SHAPES reading each of `arrays` (a chain over them, one
    read per call; together they should overflow the L2)."""
    nbytes = arrays[0].size * arrays[0].dtype.itemsize
    return min(time_per_call(lambda c, a, shape=shape: stream_read(c, a, shape),
                             jnp.zeros((shape.grid(nbytes),), jnp.uint32), arrays)
               for shape in SHAPES)
