"""Stand-ins for what runs before rank 0's tail call (sm_90a, benchmarks only), so that one GPU
can time rank 0's tail as a mesh rank runs it (benchmarks/bench_rank.py): its attention's
output x, and what the T - 1 other ranks of a TP mailbox ("ghost peers") would have delivered
into rank 0's mailbox by the time rank 0 polls.

One kernel copies x into `x_ready` (what the tail reads, so that the tail starts after this
kernel as it would after the attention kernel, with no other kernel between them), reads
rank 0's call counter (so it follows rank 0 through its buffers) and writes, into rank 0's
buffer of that call, with strong stores as a peer's publish does:
- one-shot: ghost q's rows (`rows` [(T-1)·B, H], q = 1..T-1) into slot q;
- two-shot: rank 0 owns column chunk 0, so ghost q's chunk 0 into receive slot q; and chunks
  1..T-1 of `gather` [B, H] (what their owners would have reduced) into the gather region.
It must run after rank 0's previous call (which re-armed those slots) and before its next:
the benchmark orders it through data (`after`). For XLA's per-rank work the same kernel
without a mailbox only copies x (`ready`). Each stand-in's own GPU time is left out of the
times the benchmark reports.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import jax
from cutlass import Int32, Int64

from jax_kimik3.kernels.geometry import FLAT_THREADS, VECTOR, VECTOR_BYTES
from jax_kimik3.kernels.primitives import (address_of, call_of, load_words, store_words,
                                           without_negative_zero)
from jax_kimik3.layout import MailboxSpec


class GhostPeers:
    """x copied into x_ready, and with a mailbox `spec`, rank 0's deliveries from ranks 1..T-1
    of that mailbox (one- or two-shot)."""

    def __init__(self, spec: MailboxSpec | None, two_shot: bool):
        self.spec, self.two_shot = spec, two_shot

    @cute.jit
    def __call__(self, stream, rows: cute.Tensor, gather: cute.Tensor, table: cute.Tensor,
                 x: cute.Tensor, after: cute.Tensor, x_ready: cute.Tensor):
        """`after`: any result of rank 0's previous call (orders this kernel after it)."""
        self.launch(stream, rows, gather, table, x, x_ready)

    @cute.jit
    def launch(self, stream, rows, gather, table, x: cute.Tensor, x_ready: cute.Tensor):
        sent = 0  # items: the deliveries, then x's vectors
        batch = 0
        if cutlass.const_expr(self.spec is not None):
            lay = self.spec.layout
            batch = cute.size(gather, mode=[0])
            per_row = lay.chunk // VECTOR if self.two_shot else lay.hidden // VECTOR
            sent = (lay.tp - 1) * batch * per_row
            if cutlass.const_expr(self.two_shot):
                sent = sent + batch * (lay.hidden - lay.chunk) // VECTOR
        items = sent + cute.size(x) // VECTOR
        self.kernel(rows, gather, table, x, x_ready, batch, sent, items).launch(
            grid=[(items + FLAT_THREADS - 1) // FLAT_THREADS, 1, 1],
            block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, rows, gather, table, x: cute.Tensor, x_ready: cute.Tensor, batch: Int32,
               sent: Int32, items: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * FLAT_THREADS + tidx
        if item >= sent and item < items:  # x, one vector
            at = Int64(item - sent) * VECTOR_BYTES
            store_words(Int64(x_ready.iterator.toint()) + at,
                        load_words(Int64(x.iterator.toint()) + at))
        if cutlass.const_expr(self.spec is not None):
            if item < sent:
                self.deliver(rows, gather, table, batch, item)

    @cute.jit
    def deliver(self, rows: cute.Tensor, gather: cute.Tensor, table: cute.Tensor, batch: Int32,
                item: Int32):
        """Delivery `item` (< the deliveries' count) into rank 0's buffer of its running call."""
        lay = self.spec.layout
        wait = call_of(table, 0, lay, self.spec.timeout_ns)
        per_row = lay.chunk // VECTOR if self.two_shot else lay.hidden // VECTOR
        own = (lay.tp - 1) * batch * per_row  # the ghosts' own rows (their slots)
        if item < own:
            row = item // per_row  # of rows: ghost q = row // B + 1
            vec = item - row * per_row
            q, token = row // batch + 1, row % batch
            words = without_negative_zero(load_words(
                Int64(rows.iterator.toint()) + Int64(row) * lay.row_bytes + vec * VECTOR_BYTES))
            offset = (lay.receive(wait.buffer, q, token) if self.two_shot
                      else lay.slot(wait.buffer, q, token))
            store_words(wait.mine + Int64(offset) + vec * VECTOR_BYTES, words, strong=True)
        else:  # two-shot: the other owners' reduced chunks
            rest = lay.hidden // VECTOR - lay.chunk // VECTOR
            token = (item - own) // rest
            vec = (item - own) - token * rest + lay.chunk // VECTOR
            words = without_negative_zero(load_words(
                Int64(gather.iterator.toint()) + Int64(token) * lay.row_bytes
                + vec * VECTOR_BYTES))
            store_words(address_of(table, 0) + Int64(lay.gather(wait.buffer, token))
                        + vec * VECTOR_BYTES, words, strong=True)


class Ready(GhostPeers):
    """x copied into x_ready after `after`, with no mailbox: XLA's per-rank work starts after
    it as the tail starts after GhostPeers."""

    def __init__(self):
        super().__init__(None, False)

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, after: cute.Tensor, x_ready: cute.Tensor):
        self.launch(stream, None, None, None, x, x_ready)


@functools.cache
def _kernel(spec, two_shot):
    return Ready() if spec is None else GhostPeers(spec, two_shot)


def _copied(x, inputs, spec, two_shot):
    from cutlass.jax import cutlass_call

    from jax_kimik3.kernels.lamport_ops import kernel_spec

    kernel = _kernel(None if spec is None else kernel_spec(spec), two_shot)
    flat = cutlass_call(kernel, output_shape_dtype=jax.ShapeDtypeStruct((x.size,), x.dtype))(
        *inputs)
    return flat.reshape(x.shape)


def deliver(rows, gather, table, x, after, *, spec: MailboxSpec, two_shot: bool):
    """x, copied once ghosts 1..T-1 have delivered into rank 0's mailbox for its running call:
    rows [T-1, B, H] (each ghost's rows), gather [B, H] (two-shot: the reduced rows whose
    chunks 1..T-1 other owners would send)."""
    t, b, h = rows.shape
    return _copied(x, (rows.reshape(t * b, h), gather, table, x.reshape(-1), after), spec,
                   two_shot)


def ready(x, after):
    """x, copied after `after` (any array: the kernel runs once it is computed)."""
    return _copied(x, (x.reshape(-1), after), None, False)


def is_stand_in(kernel_name: str) -> bool:
    """Whether a profiled kernel is one of these stand-ins (the DSL names a kernel after its
    module and class)."""
    return "benchmarksghost_peers" in kernel_name
