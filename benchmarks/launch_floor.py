"""The launch floor of the standalone AttnRes kernel (sm_90a, benchmarks only): a kernel of its
launch shape (a cluster of CLUSTER CTAs per token row, each thread one STANDALONE_VECTOR-wide
bf16 vector) that only copies a row [B, H] to its output: one dependent load and store, no
math, no cluster exchange. What it costs per call in a chain is what any kernel of that
shape pays before doing its work (benchmarks/bench_attn_res.py prints it beside AttnRes).
"""

from __future__ import annotations

import functools

import cutlass.cute as cute
import jax

from jax_kimik3.kernels.geometry import CLUSTER, STANDALONE_VECTOR, cta_threads
from jax_kimik3.kernels.primitives import load_f32, store, vectors


THREADS = cta_threads(STANDALONE_VECTOR)


class RowCopy:
    """out [B, H] = rows [B, H] (bf16), launched as AttnRes is: grid (CLUSTER, B), clusters of
    CLUSTER CTAs."""

    @cute.jit
    def __call__(self, stream, rows: cute.Tensor, out: cute.Tensor):
        batch = cute.size(rows, mode=[0])
        self.kernel(vectors(rows, STANDALONE_VECTOR), vectors(out, STANDALONE_VECTOR)).launch(
            grid=[CLUSTER, batch, 1], block=[THREADS, 1, 1], cluster=[CLUSTER, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, row, _ = cute.arch.block_idx()
        col = cta * THREADS + tidx
        store(out, (row, col), load_f32(rows, (row, col)))


@functools.cache
def _kernel():
    return RowCopy()


def row_copy(rows):
    """rows [B, H] bf16, copied by a kernel of the AttnRes launch shape."""
    from cutlass.jax import cutlass_call

    return cutlass_call(_kernel(), output_shape_dtype=jax.ShapeDtypeStruct(rows.shape,
                                                                           rows.dtype))(rows)
