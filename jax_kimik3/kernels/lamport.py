"""Lamport all-reduce over peer mailboxes (sm_90a): one-shot and two-shot kernels.

Rank r of T, rows [B, H] bf16, at the layer's parity (`jax_kimik3.mailbox` has the layout):
One-shot
1. producer: r's rows, each bf16 -0 rewritten to +0, go to slot r of every rank's mailbox
   (with a multicast mailbox: one multimem store that lands in all of them);
2. consumer: r polls its T slots (volatile loads, raw-bit compares with SENTINEL) until every
   word has landed, sums the slots in rank order in fp32 (so every rank gets bitwise-identical
   rows), rounds to bf16 and re-arms the slots.
Two-shot (each GPU receives ~2·B·H·2 bytes instead of T·B·H·2)
1. producer: column chunk c (H/T columns) of r's rows goes to slot r of owner c's receive region;
2. owner: r polls its T receive slots, sums them in rank order, rounds, and writes its reduced
   chunk into every rank's gather region (multicast: once); then re-arms its receive slots;
3. consumer: r polls its gather region (one slot per chunk owner's columns), copies, re-arms.

Why two parities suffice: layer i uses parity i % 2. Rank r re-arms layer L's slots (its
consumer of L) before it publishes layer L+1, and no peer can publish layer L+2, the next user
of L's parity, before it has consumed layer L+1, which needs r's L+1 rows. So L+2's rows never
land before L's re-arm. Separate kernels on one stream get "re-arm before the next publish"
from the kernel boundary; a fused producer+consumer kernel must put a `fence.acq_rel.sys`
between its re-arm stores and its next publish, or a peer may see the publish first and its
L+2 rows be overwritten by a late re-arm. The argument needs the parities to alternate from
one all-reduce to the next: after the last layer of a step with an odd layer count, layer 0
of the next step reuses parity 0, so the ranks must be ordered in between (a host sync on the
step's output, or any collective) or a fast rank's rows replace ones a peer has not read.

A consumer or owner that waits longer than `max_spins` polls on one word (a peer that never
publishes) sets its rank's status word and finishes with wrong rows: `Mailbox.check()` raises
it as a TimeoutError. Nothing spins forever.
Kernels take the peer table (uint32 [T, 2]) and the rank (int32 [1]) as inputs, and return or
take int32 tokens that order them in XLA (they share memory XLA does not see).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_kimik3.kernels.primitives import (VECTOR, VECTOR_BYTES, address_of, f32_to_words,
                                           load_words, multicast_words, poll, poll_sum, rearm,
                                           store_words, without_negative_zero)
from jax_kimik3.mailbox import SENTINEL, MailboxLayout

THREADS = 128


def _item(nvec):
    """(row, vector) of this thread in a flat [rows, nvec] grid."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    item = bidx * THREADS + tidx
    row = item // nvec
    return item, row, item - row * nvec


def _grid(batch, nvec):
    return [(batch * nvec + THREADS - 1) // THREADS, 1, 1]


@cute.jit
def store_everywhere(words, table: cute.Tensor, offset, *, tp: cutlass.Constexpr,
                     multicast: cutlass.Constexpr):
    """Store `words` at byte `offset` of every rank's mailbox (multicast: one store that lands
    in all of them)."""
    if cutlass.const_expr(multicast):
        multicast_words(address_of(table, tp) + offset, words)
    else:
        for q in cutlass.range_constexpr(tp):
            store_words(address_of(table, q) + offset, words)


@cute.jit
def publish_words(words, table: cute.Tensor, rank, row, vec, *, layout: cutlass.Constexpr,
                  parity: cutlass.Constexpr, two_shot: cutlass.Constexpr,
                  multicast: cutlass.Constexpr):
    """Publish vector `vec` (8 bf16, -0 already rewritten) of rank `rank`'s row `row`:
    one-shot into slot `rank` of every rank (multicast: one store), two-shot into slot `rank`
    of the receive region of the owner of the vector's column chunk."""
    lay = layout
    if cutlass.const_expr(not two_shot):
        offset = (Int64(lay.slot(parity, 0)) + Int64(rank) * (lay.capacity * lay.row_bytes)
                  + Int64(row) * lay.row_bytes + Int64(vec) * VECTOR_BYTES)
        store_everywhere(words, table, offset, tp=lay.tp, multicast=multicast)
    else:
        chunk_vecs, chunk_bytes = lay.chunk // VECTOR, lay.chunk * 2
        owner = vec // chunk_vecs
        offset = (Int64(lay.receive(parity, 0)) + Int64(rank) * (lay.capacity * chunk_bytes)
                  + Int64(row) * chunk_bytes + Int64(vec - owner * chunk_vecs) * VECTOR_BYTES)
        store_words(address_of(table, owner) + offset, words)


class Producer:
    """Publishes one rank's rows into the mailboxes (one-shot: every rank; two-shot: owners)."""

    def __init__(self, layout: MailboxLayout, parity: int, two_shot: bool, multicast: bool):
        self.layout, self.parity, self.two_shot, self.multicast = (
            layout, parity, two_shot, multicast)

    @cute.jit
    def __call__(self, stream, rows: cute.Tensor, table: cute.Tensor, rank: cute.Tensor,
                 after: cute.Tensor, token: cute.Tensor):
        batch = cute.size(rows, mode=[0])
        nvec = self.layout.hidden // VECTOR
        self.kernel(rows, table, rank, token, batch).launch(
            grid=_grid(batch, nvec), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, table: cute.Tensor, rank_t: cute.Tensor,
               token: cute.Tensor, batch: Int32):
        lay = self.layout
        item, row, vec = _item(lay.hidden // VECTOR)
        if row < batch:
            rank = rank_t[0]
            source = (Int64(rows.iterator.toint()) + Int64(row) * lay.row_bytes
                      + Int64(vec) * VECTOR_BYTES)
            publish_words(without_negative_zero(load_words(source)), table, rank, row, vec,
                          layout=lay, parity=self.parity, two_shot=self.two_shot,
                          multicast=self.multicast)
        if item == 0:
            token[0] = Int32(1)


class Owner:
    """Two-shot middle step: sum this rank's receive slots, send the chunk to every gather."""

    def __init__(self, layout: MailboxLayout, parity: int, batch: int, max_spins: int,
                 multicast: bool):
        self.layout, self.parity, self.batch, self.max_spins, self.multicast = (
            layout, parity, batch, max_spins, multicast)

    @cute.jit
    def __call__(self, stream, table: cute.Tensor, rank: cute.Tensor, deps: cute.Tensor,
                 token: cute.Tensor):
        self.kernel(table, rank, token).launch(
            grid=_grid(self.batch, self.layout.chunk // VECTOR), block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, rank_t: cute.Tensor, token: cute.Tensor):
        lay = self.layout
        chunk_vecs, chunk_bytes = lay.chunk // VECTOR, lay.chunk * 2
        item, row, vec = _item(chunk_vecs)
        if row < self.batch:
            rank = rank_t[0]
            mine = address_of(table, rank)
            within = Int64(row) * chunk_bytes + Int64(vec) * VECTOR_BYTES
            slots = [mine + lay.receive(self.parity, q) + within for q in range(lay.tp)]
            words = without_negative_zero(f32_to_words(
                poll_sum(slots, self.max_spins, mine + lay.status)))
            target = (Int64(lay.gather(self.parity, 0)) + Int64(row) * lay.row_bytes
                      + (Int64(rank) * chunk_vecs + Int64(vec)) * VECTOR_BYTES)
            store_everywhere(words, table, target, tp=lay.tp, multicast=self.multicast)
            rearm(slots)
        if item == 0:
            token[0] = Int32(1)


class Consumer:
    """Polls this rank's slots (one-shot: T slots; two-shot: the gather region), sums, re-arms."""

    def __init__(self, layout: MailboxLayout, parity: int, two_shot: bool, max_spins: int):
        self.layout, self.parity, self.two_shot, self.max_spins = (
            layout, parity, two_shot, max_spins)

    @cute.jit
    def __call__(self, stream, table: cute.Tensor, rank: cute.Tensor, deps: cute.Tensor,
                 out: cute.Tensor):
        batch = cute.size(out, mode=[0])
        self.kernel(table, rank, out, batch).launch(
            grid=_grid(batch, self.layout.hidden // VECTOR), block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, rank_t: cute.Tensor, out: cute.Tensor, batch: Int32):
        lay = self.layout
        item, row, vec = _item(lay.hidden // VECTOR)
        if row < batch:
            mine = address_of(table, rank_t[0])
            within = Int64(row) * lay.row_bytes + Int64(vec) * VECTOR_BYTES
            if cutlass.const_expr(self.two_shot):  # the owners' reduced chunks: a copy
                slots = [mine + lay.gather(self.parity, 0) + within]
                words = poll(slots[0], self.max_spins, mine + lay.status)
            else:
                slots = [mine + lay.slot(self.parity, q) + within for q in range(lay.tp)]
                words = f32_to_words(poll_sum(slots, self.max_spins, mine + lay.status))
            store_words(Int64(out.iterator.toint()) + within, words)
            rearm(slots)


class ArmedCheck:
    """Counts the words of every rank's armed regions that do not hold SENTINEL."""

    def __init__(self, layout: MailboxLayout):
        self.layout = layout

    @cute.jit
    def __call__(self, stream, table: cute.Tensor, after: cute.Tensor, count: cute.Tensor):
        per_rank = self.layout.armed_bytes // VECTOR_BYTES
        self.kernel(table, count).launch(grid=_grid(self.layout.tp, per_rank),
                                         block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, count: cute.Tensor):
        item, rank, vec = _item(self.layout.armed_bytes // VECTOR_BYTES)
        if rank < self.layout.tp:
            words = load_words(address_of(table, rank) + Int64(vec) * VECTOR_BYTES,
                               volatile=True)
            unarmed = Int32(0)
            for w in words:
                unarmed = unarmed + Int32(w != Uint32(SENTINEL))
            if unarmed > 0:
                cute.arch.atomic_add(count.iterator.llvm_ptr, unarmed)


@functools.cache
def producer_kernel(layout, parity, two_shot, multicast):
    return Producer(layout, parity, two_shot, multicast)


@functools.cache
def owner_kernel(layout, parity, batch, max_spins, multicast):
    return Owner(layout, parity, batch, max_spins, multicast)


@functools.cache
def consumer_kernel(layout, parity, two_shot, max_spins):
    return Consumer(layout, parity, two_shot, max_spins)


@functools.cache
def armed_check_kernel(layout):
    return ArmedCheck(layout)
