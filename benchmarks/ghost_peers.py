"""Ghost peers (sm_90a, benchmarks only): what the T - 1 other ranks of a TP mailbox would have
delivered into rank 0's mailbox by the time rank 0 polls, so that one GPU can time rank 0's
tail as a mesh rank runs it (benchmarks/bench_rank.py).

One kernel reads rank 0's call counter (so it follows rank 0 through its buffers) and writes,
into rank 0's buffer of that call, with strong stores as a peer's publish does:
- one-shot: ghost q's rows (`rows` [(T-1)·B, H], q = 1..T-1) into slot q;
- two-shot: rank 0 owns column chunk 0, so ghost q's chunk 0 into receive slot q; and chunks
  1..T-1 of `gather` [B, H] (what their owners would have reduced) into the gather region.
It must run after rank 0's previous call (which re-armed those slots) and before its next:
the benchmark orders it through data.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
from cutlass import Int32, Int64

from jax_kimik3.kernels.geometry import FLAT_THREADS, VECTOR, VECTOR_BYTES
from jax_kimik3.kernels.primitives import (address_of, call_of, load_words, store_words,
                                           without_negative_zero)
from jax_kimik3.layout import MailboxSpec


class GhostPeers:
    """Rank 0's deliveries from ranks 1..T-1 of the mailbox of `spec` (one- or two-shot)."""

    def __init__(self, spec: MailboxSpec, two_shot: bool):
        self.spec, self.two_shot, self.layout = spec, two_shot, spec.layout

    @cute.jit
    def __call__(self, stream, rows: cute.Tensor, gather: cute.Tensor, table: cute.Tensor,
                 after: cute.Tensor, done: cute.Tensor):
        """`after`: any result of rank 0's previous call (orders this kernel after it);
        `done` int32 [1]: written, so that the next call can wait for this kernel."""
        lay = self.layout
        batch = cute.size(gather, mode=[0])
        per_row = lay.chunk // VECTOR if self.two_shot else lay.hidden // VECTOR
        items = (lay.tp - 1) * batch * per_row
        if cutlass.const_expr(self.two_shot):
            items = items + batch * (lay.hidden - lay.chunk) // VECTOR
        self.kernel(rows, gather, table, done, batch, items).launch(
            grid=[(items + FLAT_THREADS - 1) // FLAT_THREADS, 1, 1],
            block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, gather: cute.Tensor, table: cute.Tensor,
               done: cute.Tensor, batch: Int32, items: Int32):
        lay = self.layout
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * FLAT_THREADS + tidx
        wait = call_of(table, 0, lay, self.spec.timeout_ns)
        per_row = lay.chunk // VECTOR if self.two_shot else lay.hidden // VECTOR
        sent = (lay.tp - 1) * batch * per_row  # the ghosts' own rows (their slots)
        if item < sent:
            row = item // per_row  # of rows: ghost q = row // B + 1
            vec = item - row * per_row
            q, token = row // batch + 1, row % batch
            words = without_negative_zero(load_words(
                Int64(rows.iterator.toint()) + Int64(row) * lay.row_bytes + vec * VECTOR_BYTES))
            offset = (lay.receive(wait.buffer, q, token) if self.two_shot
                      else lay.slot(wait.buffer, q, token))
            store_words(wait.mine + Int64(offset) + vec * VECTOR_BYTES, words, strong=True)
        elif item < items:  # two-shot: the other owners' reduced chunks
            rest = lay.hidden // VECTOR - lay.chunk // VECTOR
            token = (item - sent) // rest
            vec = (item - sent) - token * rest + lay.chunk // VECTOR
            words = without_negative_zero(load_words(
                Int64(gather.iterator.toint()) + Int64(token) * lay.row_bytes
                + vec * VECTOR_BYTES))
            store_words(address_of(table, 0) + Int64(lay.gather(wait.buffer, token))
                        + vec * VECTOR_BYTES, words, strong=True)
        if item == 0:
            done[0] = Int32(1)


@functools.cache
def _kernel(spec, two_shot):
    return GhostPeers(spec, two_shot)


def deliver(rows, gather, table, after, *, spec: MailboxSpec, two_shot: bool):
    """int32 [1], ready once ghosts 1..T-1 have delivered into rank 0's mailbox for its
    running call: rows [T-1, B, H] (each ghost's rows), gather [B, H] (two-shot: the reduced
    rows whose chunks 1..T-1 other owners would send)."""
    from cutlass.jax import cutlass_call

    from jax_kimik3.kernels.lamport_ops import kernel_spec

    t, b, h = rows.shape
    return cutlass_call(_kernel(kernel_spec(spec), two_shot),
                        output_shape_dtype=jax.ShapeDtypeStruct((1,), jnp.int32))(
        rows.reshape(t * b, h), gather, table, after)
