"""Lamport all-reduce over peer mailboxes (sm_90a): publish, two-shot owner and consumer
kernels, and `AllReduce`, the one call that launches them for R ranks.

Ranks `ranks` [R] of T, rows [R, B, H] bf16 (docs/protocol.md has the protocol;
jax_kimik3/layout.py the layout). Every kernel first reads its rank's control words: the call counter picks
the buffer (calls % 2), FAILED set means the mailbox gave up earlier (no waits, NaN out).
One-shot
1. publish: r's rows, each bf16 -0 rewritten to +0, go to slot r of every rank's mailbox
   (multicast: one multimem store lands in all of them); every thread of a publishing
   kernel runs a system-scope fence first, at the kernel's start;
2. consume: r polls its T slots (strong loads, raw-bit compares with SENTINEL) until every
   word has landed, sums the slots in rank order in fp32 (every rank gets bitwise-identical
   rows), rounds to bf16, re-arms the slots; the last CTA advances the call counters.
Two-shot (each GPU receives ~2·B·H·2 bytes instead of T·B·H·2)
1. publish: column chunk c (H/T columns) of r's rows goes to slot r of owner c's receive region;
2. owner: r polls its T receive slots, sums them in rank order, rounds, and writes its reduced
   chunk into every rank's gather region (multicast: once); then re-arms its receive slots;
3. consume: r polls its gather region (one slot per chunk owner's columns), copies, re-arms.
A wait that gives up (`primitives.poll`) writes NaN where it found no rows (the owner sends
NaN to every gather, so no consumer waits on it), records the timeout and marks every rank of
the mailbox failed: `Mailbox.check()` raises it. Nothing spins forever.
`AllReduce` launches the kernels of one call back to back on the call's stream, as one XLA
custom call: no other mailbox call can run between them. Every kernel of a call but the first
is a programmatic dependent launch (`dependent_launch`): its predecessor lets it start at
once, and the owner and consumer wait for that grid (`griddepcontrol.wait`) before they read
anything of the mailbox, so the ordering is the kernel boundary's and only their launch
overlaps (a tail's AttnRes kernel, after the owner, does not: docs/protocol.md, "Dependent
launches"). R = 1 is a
mesh rank (its index from `axis_index`); R = T is virtual TP (every rank on one GPU: every
publish, then every owner, then every consumer).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_kimik3.kernels.geometry import FLAT_THREADS, VECTOR, VECTOR_BYTES
from jax_kimik3.kernels.primitives import (address_of, arrive, call_of, dependent_launch,
                                           f32_to_words, fence_system, finish_call,
                                           let_next_launch, load_words, multicast_words,
                                           poison_words, poll, poll_sum, rearm, received_slots,
                                           store_words, wait_for_previous,
                                           without_negative_zero)
from jax_kimik3.layout import SENTINEL, WAITER, MailboxLayout, MailboxSpec



def _item(nvec):
    """(item, row, vector) of this thread in a flat [rows, nvec] grid (rows: R·B); the
    last CTA's items past the end are the caller's to skip."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    item = bidx * FLAT_THREADS + tidx
    row = item // nvec
    return item, row, item - row * nvec


def _grid(rows, nvec):
    return [(rows * nvec + FLAT_THREADS - 1) // FLAT_THREADS, 1, 1]


@cute.jit
def store_everywhere(words, table: cute.Tensor, offset, *, tp: cutlass.Constexpr,
                     multicast: cutlass.Constexpr):
    """Store `words` at byte `offset` of every rank's mailbox (multicast: one store that lands
    in all of them)."""
    if cutlass.const_expr(multicast):
        multicast_words(address_of(table, tp) + offset, words)
    else:
        for q in cutlass.range_constexpr(tp):
            store_words(address_of(table, q) + offset, words, strong=True)


@cute.jit
def publish_words(words, wait, rank, row, vec, *, two_shot: cutlass.Constexpr,
                  multicast: cutlass.Constexpr):
    """Publish vector `vec` (8 bf16, -0 already rewritten) of rank `rank`'s row `row` in the
    call of `wait`: one-shot into slot `rank` of every rank (multicast: one store), two-shot
    into slot `rank` of the receive region of the owner of the vector's column chunk. Nothing
    on a failed mailbox. The calling thread ran `fence_system` at its kernel's start: the
    release that orders its rank's earlier kernels (the last call's re-arms) before these
    stores."""
    lay = wait.layout
    if wait.failed == Int32(0):
        if cutlass.const_expr(not two_shot):
            offset = (Int64(lay.slot(wait.buffer, rank, row)) + Int64(vec) * VECTOR_BYTES)
            store_everywhere(words, wait.table, offset, tp=lay.tp, multicast=multicast)
        else:
            chunk_vecs = lay.chunk // VECTOR
            owner = vec // chunk_vecs
            offset = (Int64(lay.receive(wait.buffer, rank, row))
                      + Int64(vec - owner * chunk_vecs) * VECTOR_BYTES)
            store_words(address_of(wait.table, owner) + offset, words, strong=True)


class AllReduce:
    """The all-reduce of R ranks' rows through a mailbox: rows [R·B, H] → out [R·B, H]."""

    def __init__(self, spec: MailboxSpec, ranks: int, two_shot: bool):
        self.spec, self.ranks, self.two_shot = spec, ranks, two_shot
        self.layout: MailboxLayout = spec.layout

    @cute.jit
    def __call__(self, stream, rows: cute.Tensor, table: cute.Tensor, ranks: cute.Tensor,
                 out: cute.Tensor):
        batch = cute.size(rows, mode=[0]) // self.ranks
        self.launch_publish(stream, rows, table, ranks, batch)
        self.launch_owner(stream, table, ranks, batch)
        dependent_launch(self.consume(table, ranks, out, batch),
                         grid=_grid(self.ranks * batch, self.layout.hidden // VECTOR),
                         block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.jit
    def launch_publish(self, stream, rows: cute.Tensor, table: cute.Tensor, ranks: cute.Tensor,
                       batch):
        """The publish kernel of rows [R·B, H] (the tail of XLA's dot launches it too)."""
        self.publish(rows, table, ranks, batch).launch(
            grid=_grid(self.ranks * batch, self.layout.hidden // VECTOR),
            block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.jit
    def launch_owner(self, stream, table: cute.Tensor, ranks: cute.Tensor, batch):
        """Two-shot only: the owner kernel, between the publish and the consumer (this
        call's or, in kernels/tail.py, an AttnRes kernel)."""
        if cutlass.const_expr(self.two_shot):
            dependent_launch(self.reduce_chunk(table, ranks, batch),
                             grid=_grid(self.ranks * batch, self.layout.chunk // VECTOR),
                             block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def publish(self, rows: cute.Tensor, table: cute.Tensor, ranks: cute.Tensor, batch: Int32):
        fence_system()  # release: the earlier kernels' re-arms before this kernel's stores
        let_next_launch()
        lay = self.layout
        _, row, vec = _item(lay.hidden // VECTOR)
        if row < self.ranks * batch:
            i = row // batch
            wait = call_of(table, ranks[i], lay, self.spec.timeout_ns)
            source = (Int64(rows.iterator.toint()) + Int64(row) * lay.row_bytes
                      + Int64(vec) * VECTOR_BYTES)
            publish_words(without_negative_zero(load_words(source)), wait, ranks[i],
                          row - i * batch, vec, two_shot=self.two_shot,
                          multicast=self.spec.multicast)

    @cute.kernel
    def reduce_chunk(self, table: cute.Tensor, ranks: cute.Tensor, batch: Int32):
        """Two-shot owner: sum this rank's receive slots, send the chunk to every gather."""
        let_next_launch()
        wait_for_previous()  # the publish
        lay = self.layout
        chunk_vecs, chunk_bytes = lay.chunk // VECTOR, lay.chunk * 2
        _, item, vec = _item(chunk_vecs)
        if item < self.ranks * batch:
            i = item // batch
            row = item - i * batch
            rank = ranks[i]
            wait = call_of(table, rank, lay, self.spec.timeout_ns, WAITER.OWNER)
            within = Int64(row) * chunk_bytes + Int64(vec) * VECTOR_BYTES
            slots = [wait.mine + Int64(lay.receive(wait.buffer, q)) + within
                     for q in range(lay.tp)]
            acc, ok = poll_sum(slots, list(range(lay.tp)), wait)
            words = without_negative_zero(f32_to_words(acc))  # NaN where a slot was missing
            target = (Int64(lay.gather(wait.buffer, row))
                      + (Int64(rank) * chunk_vecs + Int64(vec)) * VECTOR_BYTES)
            fence_system()  # the re-arms of this rank's last call before its gather stores
            store_everywhere(words, table, target, tp=lay.tp, multicast=self.spec.multicast)
            rearm(slots)

    @cute.kernel
    def consume(self, table: cute.Tensor, ranks: cute.Tensor, out: cute.Tensor, batch: Int32):
        """Poll this rank's slots (one-shot: T slots; two-shot: the gather region), sum,
        re-arm; NaN where a wait gave up. The last CTA advances the call counters."""
        wait_for_previous()  # the publish or the owner
        lay = self.layout
        tidx, _, _ = cute.arch.thread_idx()
        _, item, vec = _item(lay.hidden // VECTOR)
        if item < self.ranks * batch:
            i = item // batch
            row = item - i * batch
            wait = call_of(table, ranks[i], lay, self.spec.timeout_ns, WAITER.CONSUMER)
            slots, peers = received_slots(wait, row, vec, two_shot=self.two_shot)
            if cutlass.const_expr(self.two_shot):  # the owners' reduced chunks: a copy
                words, ok = poll(slots[0], wait, peers[0])
                words = poison_words(words, ok)
            else:
                acc, ok = poll_sum(slots, peers, wait)
                words = f32_to_words(acc)
            store_words(Int64(out.iterator.toint()) + Int64(item) * lay.row_bytes
                        + Int64(vec) * VECTOR_BYTES, words)
            rearm(slots)
        cute.arch.barrier()  # every thread of the CTA has read the control words
        if tidx == 0:
            finish_call(arrive(table, ranks, lay), table, ranks, self.ranks, lay)


class ArmedCheck:
    """Counts the words of every rank's armed regions that do not hold SENTINEL."""

    def __init__(self, layout: MailboxLayout):
        self.layout = layout

    @cute.jit
    def __call__(self, stream, table: cute.Tensor, after: cute.Tensor, count: cute.Tensor):
        per_rank = self.layout.armed_bytes // VECTOR_BYTES
        self.kernel(table, count).launch(grid=_grid(self.layout.tp, per_rank),
                                         block=[FLAT_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, count: cute.Tensor):
        _, rank, vec = _item(self.layout.armed_bytes // VECTOR_BYTES)
        if rank < self.layout.tp:
            words = load_words(address_of(table, rank) + Int64(vec) * VECTOR_BYTES, strong=True)
            unarmed = Int32(0)
            for w in words:
                unarmed = unarmed + Int32(w != Uint32(SENTINEL))
            if unarmed > 0:
                cute.arch.atomic_add(count.iterator.llvm_ptr, unarmed)


@functools.cache
def all_reduce_kernel(spec, ranks, two_shot):
    return AllReduce(spec, ranks, two_shot)


@functools.cache
def armed_check_kernel(layout):
    return ArmedCheck(layout)
