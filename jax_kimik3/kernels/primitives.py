"""Shared CuTe DSL primitives: row vectors, CTA and cluster sums, the mailbox's memory
operations, bounded waits and the call counter; this module defines no kernel.

Memory semantics of the mailbox (docs/protocol.md has the argument):
- every store a peer polls for (publish, the two-shot owner's gather store, re-arm, the
  FAILED word) is a strong `st.relaxed.sys`; every poll a strong `ld.relaxed.sys`, which
  re-reads memory each time: no data race in PTX's memory model, no cached copy;
- every thread of a publishing kernel that stores into a mailbox (in the producer only those;
  the others need not) runs `fence.release.sys` first, at the kernel's start:
  the earlier kernels of its stream (the previous call's polls and re-arms) are complete when
  it starts, and the fence followed by the thread's strong stores is a release pattern, so the
  re-arms, and the polls with what they observed of the peers' rows (a release is
  cumulative), are ordered before the publish at system scope: no peer can see this call's
  rows and publish the next call's into a slot this rank still re-arms. A release, not
  acq_rel: no later load of the kernel needs ordering, and the acquire half invalidates the
  SM's L1 (CCTL.IVALL). (At the start the thread has nothing in flight, so the fence costs
  little; before the publish it waited for the GEMM's loads.) The two-shot owner fences
  between its poll and its gather store, which it makes from what it polled;
- control words of this rank (call counter, arrivals) are read and written by this rank's
  kernels only, ordered by kernel boundaries and GPU-scope atomics: each CTA of a call's last
  kernel `arrive`s (a release) once it is done with the call counter, and the last one, once
  the call's other kernels have completed, acquires and advances it (`finish_call`);
- a call's kernels after its first are programmatic dependent launches (`dependent_launch`):
  they may start while the kernel before them runs; `griddepcontrol.wait`
  (`wait_for_previous`) returns once that grid has completed and its memory is visible. The
  owner and consumer touch the mailbox only after it; the tail's AttnRes kernel reads its
  control words, polls and re-arms before it (a Lamport slot holds the sentinel or this
  call's row) and waits only before it advances the call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_kimik3.kernels.geometry import SWIZZLED_ROW_BYTES, VECTOR, VECTOR_BYTES, WARP
from jax_kimik3.layout import CONTROL, POLL_PAUSE_NS, SENTINEL

NEG_ZERO_BF16 = 0x8000
NAN_BF16_PAIR = 0x7FC07FC0  # two bf16 quiet NaNs: OR-ed into a word, it reads as NaN
NAN_F32 = 0x7FC00000


def vectors(tensor: cute.Tensor, width: int = VECTOR) -> cute.Tensor:
    """View a row-major tensor as (`width`-wide vectors, index of the vector); last mode split."""
    tile = (1,) * (cute.rank(tensor) - 1) + (width,)
    return cute.zipped_divide(tensor, tile)


@cute.jit
def load_vector(vecs: cute.Tensor, index):
    """The elements of vector `index`, as stored (a TensorSSA: VECTOR bf16, four registers)."""
    frag = cute.make_rmem_tensor(cute.size(vecs, mode=[0]), vecs.element_type)
    cute.autovec_copy(vecs[(None, index)], frag)
    return frag.load()


@cute.jit
def load_f32(vecs: cute.Tensor, index):
    """The elements of vector `index`, converted to fp32 (a TensorSSA)."""
    return load_vector(vecs, index).to(Float32)


@cute.jit
def store(vecs: cute.Tensor, index, values):
    """Store the fp32 TensorSSA `values` into vector `index`, converted to the tensor's type."""
    frag = cute.make_rmem_tensor(cute.size(vecs, mode=[0]), vecs.element_type)
    frag.store(values.to(vecs.element_type))
    cute.autovec_copy(frag, vecs[(None, index)])


@dsl_user_op
def store_to_peer_f32(local: cute.Pointer, peer, value, *, loc=None, ip=None):
    """Weak `st.shared::cluster.f32` of `value` at CTA `peer`'s copy of shared address `local`.

    Ordering comes from the caller's cluster barrier (arrive has release semantics)."""
    _asm(None, [Int32(local.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
                Int32(peer).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1; "
         "st.shared::cluster.f32 [remote], $2; }", "r,r,f", effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_to_peer_async_f32(local: cute.Pointer, landed: cute.Pointer, peer, value, *, loc=None,
                            ip=None):
    """`st.async` of `value` at CTA `peer`'s copy of shared address `local`, completing 4 bytes
    of the transaction count of `peer`'s copy of the mbarrier `landed`: the peer waits on its
    mbarrier, and neither side needs a cluster barrier (whose release arrive is a GPU-scope
    fence that waits for this thread's global stores)."""
    _asm(None, [Int32(local.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
                Int32(landed.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
                Int32(peer).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "{ .reg .b32 remote, bar; mapa.shared::cluster.u32 remote, $0, $2; "
         "mapa.shared::cluster.u32 bar, $1, $2; "
         "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [remote], $3, [bar]; }",
         "r,r,r,f", effects=True, loc=loc, ip=ip)


@dsl_user_op
def wait_exchange(landed: cute.Pointer, *, loc=None, ip=None):
    """Wait until the mbarrier `landed` completes phase 0: `mbarrier.try_wait` with acquire at
    cluster scope, the scope of the peers' `st.async` releases (the default, CTA scope, does not
    synchronise with them)."""
    _asm(None, [Int32(landed.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)],
         "{ .reg .pred landed; WAIT: "
         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 landed, [$0], 0, 10000000; "
         "@landed bra.uni DONE; bra.uni WAIT; DONE: }", "r", effects=True, loc=loc, ip=ip)


@cute.jit
def arm_exchange(landed: cute.Pointer, exchanges: cutlass.Constexpr = 1):
    """Thread 0's set-up of `exchanges` `cluster_sums(landed=)` exchanges, before the kernel's
    `cluster_arrive_relaxed` (which, after `fence.mbarrier_init`, makes them visible to the
    peers): an mbarrier of one arrival each at `landed`, `landed` + 1, ..., which
    `cluster_sums` makes with the bytes it expects."""
    for e in cutlass.range_constexpr(exchanges):
        cute.arch.mbarrier_init(landed + e, 1)
    cute.arch.mbarrier_init_fence()


def warp_scatter_sums(values: list, lane) -> list:
    """The warp's sum of each of the per-thread `values` (fp32), spread over its lanes: per
    group of up to WARP values, (this lane's sum, the sum's index in `values`, whether this lane
    is the one that stores it). A halving step keeps one half of the lane's values, sends the
    other half to lane ^ offset (which keeps that half) and adds what comes back; then a
    butterfly over the lanes' remaining bits: 31 shuffles for P = 32 values in all (P the power
    of two at or above their count; zeros pad), against a butterfly's five per value. Plain Python
    over the DSL's operations (no control flow), called from kernel code."""
    out = []
    for start in range(0, len(values), WARP):
        v = list(values[start:start + WARP])
        size = 1 << (len(v) - 1).bit_length()
        v += [Float32(0.0)] * (size - len(v))
        index, offset = Int32(start), WARP // 2
        while len(v) > 1:
            half = len(v) // 2
            upper = (lane & offset) != 0  # this lane keeps the upper half
            kept = [Float32(cutlass.select_(upper, v[i + half], v[i])) for i in range(half)]
            sent = [Float32(cutlass.select_(upper, v[i], v[i + half])) for i in range(half)]
            v = [k + cute.arch.shuffle_sync_bfly(x, offset=offset) for k, x in zip(kept, sent)]
            index = index + Int32(cutlass.select_(upper, Int32(half), Int32(0)))
            offset //= 2
        total = v[0]
        while offset:
            total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
            offset //= 2
        out.append((total, index, lane % (WARP // size) == 0))
    return out


def slot_totals(cluster_buf, n: int, cluster_size: int, lane) -> list:
    """Step 5 of `cluster_sums`: the sum over the CTAs' slots of `cluster_buf` [cluster_size, n]
    of each of the n values, in rank order, on every lane. Lane j adds the slots of one value
    (per group of up to WARP values: lanes past the group's last value repeat it) and a shuffle
    from lane j hands that sum to every lane: cluster_size loads and adds and n shuffles per
    lane, where each lane adding every value's slots takes n·cluster_size of each. Plain Python
    over the DSL's operations, called from kernel code."""
    sums = []
    for start in range(0, n, WARP):
        count = min(WARP, n - start)
        k = Int32(start) + Int32(cutlass.select_(lane < count, lane, Int32(count - 1)))
        total = Float32(0.0)
        for c in range(cluster_size):
            total = total + cluster_buf[c, k]
        sums += [cute.arch.shuffle_sync(total, offset=j) for j in range(count)]
    return sums


@cute.jit
def warp_sums(values: list, warp_buf: cute.Tensor, first: cutlass.Constexpr = 0):
    """Steps 1-2 of `cluster_sums`: the warp's sum of each per-thread fp32 in `values`, spread
    over the lanes (`warp_scatter_sums`); the lanes that hold them write them to row `warp` of
    `warp_buf`, at `first` + their index. A kernel takes them early (before a tail's poll) for
    what the poll does not change, and `cluster_sums(first=)` the rest."""
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    for total, k, stores in warp_scatter_sums(values, lane):
        if stores & (k < len(values)):
            warp_buf[warp, first + k] = total


@cute.jit
def cluster_sums(values: list, warp_buf: cute.Tensor, cluster_buf: cute.Tensor,
                 cluster_size: cutlass.Constexpr, rank, landed=None,
                 first: cutlass.Constexpr = 0):
    """Sum each per-thread fp32 in `values` over every thread of every CTA of the cluster;
    with `first`, entries 0..first-1 of this warp's row of `warp_buf` already hold its sums of
    earlier values (`warp_sums`), and the result has all first + len(values) sums.

    1. a warp sum spread over the lanes (`warp_scatter_sums`); 2. the lanes that hold the
    warp totals write them to `warp_buf` [warps, n] (`warp_sums`);
    3. for each (CTA t, value k), one of the threads adds the warp totals of k (fixed order)
    and stores the CTA total into slot `rank` of CTA t's `cluster_buf` [cluster_size, n]
    through distributed shared memory (cluster_size·n stores spread over the threads, not
    n in a row on each of cluster_size threads);
    4. a cluster barrier (arrive: release, wait: acquire) publishes the stores;
    5. each value's slots are added in rank order, so all CTAs hold bitwise-equal sums
       (`slot_totals`).
    The caller must have synchronised the cluster once since launch (peers' shared memory
    exists), and gives each call its own `cluster_buf`. With `landed` (this CTA's mbarrier,
    set up by `arm_exchange`; one exchange per mbarrier) steps 3-4 are `st.async` stores
    that complete on the peer's mbarrier, and a wait on this CTA's own (`wait_exchange`).
    """
    n = first + len(values)
    if cutlass.const_expr(n != cute.size(cluster_buf, mode=[1])):
        # CTA t's total of value k goes to slot rank·n + k of each peer's row-major buffer.
        raise ValueError(f"cluster_sums: {n} values, but cluster_buf holds "
                         f"{cute.size(cluster_buf, mode=[1])} per CTA")
    warps = cute.size(warp_buf, mode=[0])
    tidx, _, _ = cute.arch.thread_idx()
    warp_sums(values, warp_buf, first)
    if cutlass.const_expr(landed is not None):
        if tidx == 0:  # the peers' stores may land first: the count goes below zero meanwhile
            cute.arch.mbarrier_arrive_and_expect_tx(landed, 4 * cluster_size * n)
    cute.arch.barrier()
    threads = warps * WARP  # the threads that call it: warp_buf has a row per warp
    for j in cutlass.range_constexpr((cluster_size * n + threads - 1) // threads):
        pair = tidx + j * threads
        if pair < cluster_size * n:
            peer = pair // n
            k = pair - peer * n
            cta = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                cta = cta + warp_buf[w, k]
            if cutlass.const_expr(landed is None):
                store_to_peer_f32(cluster_buf.iterator + (rank * n + k), peer, cta)
            else:
                store_to_peer_async_f32(cluster_buf.iterator + (rank * n + k), landed, peer, cta)
    if cutlass.const_expr(landed is None):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    else:
        wait_exchange(landed)
    return slot_totals(cluster_buf, n, cluster_size, cute.arch.lane_idx())


def dependent_launch(kernel, **launch):
    """Launch `kernel` (a configured kernel call) as a programmatic dependent launch: it may
    start once every CTA of the stream's previous kernel has run
    `griddepcontrol.launch_dependents`, and must `griddepcontrol.wait` (`wait_for_previous`)
    before it relies on that kernel having completed."""
    kernel.launch(use_pdl=True, **launch)


def let_next_launch():
    """`griddepcontrol.launch_dependents`: the stream's next kernel, if it is a dependent
    launch, may start now."""
    cute.arch.griddepcontrol_launch_dependents()


def wait_for_previous():
    """`griddepcontrol.wait`: the stream's previous kernel has completed and its memory is
    visible (at once in a kernel that was not a dependent launch)."""
    cute.arch.griddepcontrol_wait()


@dsl_user_op
def prefetch_line(address: Int64, *, loc=None, ip=None):
    """prefetch.global.L1 of the line at `address`: a later load of it hits L1, and no
    register holds it meanwhile."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip)], "prefetch.global.L1 [$0];", "l",
         effects=True, loc=loc, ip=ip)


@cute.jit
def prefetch(vecs: cute.Tensor, index):
    """Bring vector `index` of `vecs` (as `vectors` views it) into L1 for a later `load_f32`."""
    prefetch_line(Int64(vecs[(None, index)].iterator.toint()))


# Lamport mailbox words: each helper takes a raw 64-bit global address (peer buffers are
# reached through the unified address space) and moves four 32-bit words = 8 bf16.

def _asm(result, args, text, constraints, *, effects, loc, ip):
    return llvm.inline_asm(result, args, text, constraints, has_side_effects=effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
                           ip=ip)


@dsl_user_op
def load_words(address: Int64, *, strong: cutlass.Constexpr[bool] = False, loc=None, ip=None):
    """16 bytes at `address` as four Uint32. `strong` (ld.relaxed.sys, a poll): every call
    re-reads memory, never a register or L1 copy, and is not hoisted or merged."""
    opcode = "ld.relaxed.sys.global.v4.u32" if strong else "ld.global.v4.u32"
    out = _asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(address).ir_value(loc=loc, ip=ip)],
               f"{opcode} {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,l", effects=strong, loc=loc,
               ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def load_word(address: Int64, *, loc=None, ip=None):
    """The 32-bit word at `address`, strong (ld.relaxed.sys: re-read every time)."""
    return Uint32(_asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip)],
                       "ld.relaxed.sys.global.u32 $0, [$1];", "=r,l", effects=True, loc=loc,
                       ip=ip))


@dsl_user_op
def stream_words(address: Int64, *, loc=None, ip=None):
    """16 read-only bytes at `address` as four Uint32, streamed: a non-coherent load that
    skips L1 and asks L2 for the whole 256-byte line (weights read once per call)."""
    out = _asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(address).ir_value(loc=loc, ip=ip)],
               "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,l", effects=False, loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def copy_to_shared(shared: Int32, address: Int64, *, loc=None, ip=None):
    """`cp.async.cg` of 16 read-only bytes at global `address` into shared address `shared`,
    through L2 only (not L1). The copy is asynchronous: it lands once `wait_for_copies` says
    its commit group has, and other threads see it only after a CTA barrier."""
    _asm(None, [Int32(shared).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", effects=True, loc=loc, ip=ip)


@dsl_user_op
def commit_copies(*, loc=None, ip=None):
    """`cp.async.commit_group`: this thread's copies since the last commit form one group (an
    empty group if there were none)."""
    _asm(None, [], "cp.async.commit_group;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def wait_for_copies(pending: cutlass.Constexpr[int], *, loc=None, ip=None):
    """`cp.async.wait_group`: every commit group of this thread but the `pending` newest has
    landed in shared memory."""
    _asm(None, [], f"cp.async.wait_group {pending};", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def mma_bf16(a, b, c, *, loc=None, ip=None):
    """One warp-wide `mma.sync.m16n8k16` (bf16 in, fp32 accumulate): D = A·B + C with this
    lane's fragments a (4 words), b (2 words), c (4 fp32); returns D's 4 fp32."""
    out = _asm(llvm.StructType.get_literal([T.f32()] * 4),
               [Uint32(w).ir_value(loc=loc, ip=ip) for w in (*a, *b)]
               + [Float32(v).ir_value(loc=loc, ip=ip) for v in c],
               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
               "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", effects=False, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


# wgmma (sm_90a): a warpgroup's multiply-accumulate from two operands in shared memory, each
# K-major in 128-byte swizzled rows: row r of an operand's 64-wide k slice is 128 bytes at r·128,
# its 16-byte unit u at u ^ (r % 8), the slice 1024-byte aligned (the descriptor's base).
# Descriptor bits 32-63: 8-row groups 1024 bytes apart (the stride, in 16-byte units), 128-byte
# swizzle (layout type 1 at bit 62); bits 0-13 are the start address in 16-byte units.
_DESCRIPTOR_HIGH = ((8 * SWIZZLED_ROW_BYTES) >> 4 << 32) | (1 << 62)


@dsl_user_op
def fence_async_shared(*, loc=None, ip=None):
    """`fence.proxy.async.shared::cta`: this thread's shared-memory writes so far (its landed
    copies) come before the async proxy's reads of them (wgmma's operands)."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def warpgroup_fence(*, loc=None, ip=None):
    """`wgmma.fence`: the accumulator registers written so far come before the next wgmma."""
    _asm(None, [], "wgmma.fence.sync.aligned;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def warpgroup_commit(*, loc=None, ip=None):
    """`wgmma.commit_group`: this warpgroup's wgmmas since the last commit form one group."""
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def warpgroup_wait(pending: cutlass.Constexpr[int], *, loc=None, ip=None):
    """`wgmma.wait_group`: every wgmma group but the `pending` newest has completed (its
    accumulators are written and its shared-memory reads done)."""
    _asm(None, [], f"wgmma.wait_group.sync.aligned {pending};", "", effects=True, loc=loc,
         ip=ip)


@dsl_user_op
def wgmma_bf16(a: Int32, b: Int32, acc, *, loc=None, ip=None):
    """One `wgmma.mma_async.m64nNk16` (bf16 in, fp32 accumulate, N = 2·len(acc)): acc += A·Bᵀ
    with A [64, 16] at shared address `a` and B [N, 16] at `b`, both K-major and swizzled
    (SWIZZLED_ROW_BYTES). This warp's acc[4j + i] is row 16·(warp % 4) + lane / 4 + 8·(i // 2),
    column 8j + 2·(lane % 4) + i % 2: mma.sync's fragment, warp by warp. Asynchronous: acc is
    read only after `warpgroup_commit` and `warpgroup_wait`."""
    count = len(acc)  # fp32 values per thread: N / 2
    n = 2 * count
    descriptors = [Int64(Int64(Int32(address) >> 4) | Int64(_DESCRIPTOR_HIGH))
                   .ir_value(loc=loc, ip=ip) for address in (a, b)]
    regs = ", ".join(f"${i}" for i in range(count))
    out = _asm(llvm.StructType.get_literal([T.f32()] * count),
               [Float32(v).ir_value(loc=loc, ip=ip) for v in acc] + descriptors
               + [Int32(1).ir_value(loc=loc, ip=ip)],
               f"{{ .reg .pred d; setp.ne.b32 d, ${n + 2}, 0; "  # scale-d: accumulate
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, "
               f"${n}, ${n + 1}, d, 1, 1, 0, 0; }}",
               ",".join(["=f"] * count + [str(i) for i in range(count)] + ["l", "l", "r"]),
               effects=True, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def store_words(address: Int64, words, *, strong: cutlass.Constexpr[bool] = False, loc=None,
                ip=None):
    """st.global.v4 of four words: weak for an ordinary output, `strong` (st.relaxed.sys) for
    a mailbox word a peer polls. A Lamport reader polls every word, so a publish needs no flag:
    each word either still holds SENTINEL or holds its final value."""
    opcode = "st.relaxed.sys.global.v4.b32" if strong else "st.global.v4.b32"
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip)]
         + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
         f"{opcode} [$0], {{$1, $2, $3, $4}};", "l,r,r,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def multicast_words(address: Int64, words, *, loc=None, ip=None):
    """`multimem.st.relaxed.sys.global.v4.f32` of four words at a multicast address: the same
    16 bytes land in every bound rank's buffer (raw bits; nothing is added)."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip)]
         + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
         "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_word(address: Int64, word, *, loc=None, ip=None):
    """Strong st.relaxed.sys.global.u32 of one (control) word."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(word).ir_value(loc=loc, ip=ip)],
         "st.relaxed.sys.global.u32 [$0], $1;", "l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def or_word(address: Int64, bits, *, loc=None, ip=None):
    """red.relaxed.gpu.global.or.b32: OR `bits` into the word at `address` (no result)."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(bits).ir_value(loc=loc, ip=ip)],
         "red.relaxed.gpu.global.or.b32 [$0], $1;", "l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def increment_word(address: Int64, *, loc=None, ip=None):
    """red.relaxed.gpu.global.add.u32: add 1 to the word at `address` (no result, so no round
    trip)."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip)],
         "red.relaxed.gpu.global.add.u32 [$0], 1;", "l", effects=True, loc=loc, ip=ip)


@dsl_user_op
def add_word(address: Int64, value, *, loc=None, ip=None):
    """atom.release.gpu.global.add.u32: add `value` to the word at `address`, after this
    thread's earlier memory operations (and what a CTA barrier showed it); its old value."""
    return Uint32(_asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip),
                                 Uint32(value).ir_value(loc=loc, ip=ip)],
                       "atom.release.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r", effects=True,
                       loc=loc, ip=ip))


@dsl_user_op
def fence_acquire_gpu(*, loc=None, ip=None):
    """fence.acquire.gpu: after a strong read, an acquire pattern at GPU scope (PTX 8.6+). In
    SASS only `CCTL.IVALL`; acq_rel would add `MEMBAR.ALL.GPU`, which waits for this thread's
    earlier stores, and nothing after it needs them first."""
    _asm(None, [], "fence.acquire.gpu;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def fence_system(*, loc=None, ip=None):
    """fence.release.sys: this thread's earlier memory operations (and, by the kernel
    boundary, its rank's earlier kernels') are ordered before its later stores at system
    scope; with a later strong store, a release pattern. (No acquire: the acq_rel fence would
    also invalidate the SM's L1, CCTL.IVALL in SASS, which no later load here needs.)"""
    _asm(None, [], "fence.release.sys;", "", effects=True, loc=loc, ip=ip)


def received_slots(wait, row, vec, *, two_shot):
    """(addresses, ranks): where a consumer polls vector `vec` of row `row` in its own mailbox
    in the call of `wait`: one-shot, every rank's slot in rank order; two-shot, the gather
    region, which the owner of the vector's column chunk fills."""
    lay = wait.layout
    within = Int64(row) * lay.row_bytes + Int64(vec) * VECTOR_BYTES
    if two_shot:
        return ([wait.mine + Int64(lay.gather(wait.buffer)) + within],
                [vec // (lay.chunk // VECTOR)])
    return ([wait.mine + Int64(lay.slot(wait.buffer, q)) + within for q in range(lay.tp)],
            list(range(lay.tp)))


@dsl_user_op
def pause(ns: cutlass.Constexpr[int], *, loc=None, ip=None):
    """nanosleep.u32: this warp sleeps about `ns` nanoseconds (at most twice that), leaving its
    issue slots to the SM's other warps."""
    _asm(None, [], f"nanosleep.u32 {ns};", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def global_timer(*, loc=None, ip=None):
    """The GPU's global nanosecond timer (%globaltimer)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", effects=True, loc=loc,
                      ip=ip))


@dsl_user_op
def _bits_to_f32(bits, *, loc=None, ip=None):
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _f32_to_bits(value, *, loc=None, ip=None):
    return Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def words_to_f32(words):
    """Eight fp32 from four words of bf16 pairs (low half first): a bf16 is an fp32's top half."""
    values = []
    for w in words:
        values.append(_bits_to_f32(w << Uint32(16)))
        values.append(_bits_to_f32(w & Uint32(0xFFFF0000)))
    return values


@dsl_user_op
def f32_to_words(values, *, loc=None, ip=None):
    """Four words of bf16 pairs from eight fp32, rounded to nearest even (cvt.rn.bf16x2.f32)."""
    words = []
    for i in range(4):
        low, high = (Float32(v).ir_value(loc=loc, ip=ip) for v in values[2 * i: 2 * i + 2])
        word = llvm.inline_asm(T.i32(), [high, low], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                               has_side_effects=False, is_align_stack=False,
                               asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        words.append(Uint32(word))
    return words


@cute.jit
def without_negative_zero(words):
    """Each bf16 -0 (0x8000) rewritten to +0, so no published word can equal SENTINEL."""
    clean = []
    for w in words:  # branch-free: clear the sign bit of a half that is exactly 0x8000
        low = Uint32((w & Uint32(0xFFFF)) == Uint32(NEG_ZERO_BF16))
        high = Uint32((w >> Uint32(16)) == Uint32(NEG_ZERO_BF16))
        clean.append(w & (Uint32(0xFFFFFFFF) ^ ((low << Uint32(15)) | (high << Uint32(31)))))
    return clean


@cute.jit
def poison_words(words, ok):
    """The four words unchanged where `ok` (Int32 0/1), else NaN bf16 pairs (never SENTINEL)."""
    mask = (Uint32(1) - Uint32(ok)) * Uint32(NAN_BF16_PAIR)
    return [w | mask for w in words]


@cute.jit
def poison_f32(values, ok):
    """The fp32 values unchanged where `ok` (Int32 0/1), else NaN."""
    mask = (Uint32(1) - Uint32(ok)) * Uint32(NAN_F32)
    return [_bits_to_f32(_f32_to_bits(v) | mask) for v in values]


@cute.jit
def no_nan(values):
    """Int32 1 where none of the fp32 `values` is a NaN (compared as bits: fast math cannot
    fold it away), else 0."""
    ok = Int32(1)
    for v in values:
        ok = ok * Int32((_f32_to_bits(v) & Uint32(0x7FFFFFFF)) <= Uint32(0x7F800000))
    return ok


@cute.jit
def one_or_nan(ok):
    """1.0 where `ok` (Int32 0/1), else NaN: a factor that poisons a row, exact otherwise."""
    return _bits_to_f32(Uint32(0x3F800000) + (Uint32(1) - Uint32(ok))
                        * Uint32(NAN_F32 - 0x3F800000))


@cute.jit
def is_armed(words):
    """Whether any word still holds SENTINEL (compared as raw bits, never as floats)."""
    armed = words[0] == Uint32(SENTINEL)
    for i in cutlass.range_constexpr(1, 4):
        armed = armed | (words[i] == Uint32(SENTINEL))
    return armed


@cute.jit
def address_of(table: cute.Tensor, rank):
    """Rank `rank`'s buffer address from the peer table's (low, high) uint32 words (row T:
    the multicast address)."""
    low, high = Int64(table[rank, 0]), Int64(table[rank, 1])  # Int64() sign-extends a uint32
    mask = Int64(0xFFFFFFFF)
    return ((high & mask) << Int64(32)) | (low & mask)


class Wait(NamedTuple):
    """One rank's view of a call on its mailbox (`call_of`): where its buffer and control words
    are, which buffer the call uses, and how its waits end (docs/protocol.md, Timeouts)."""

    table: Any  # the peer table tensor
    mine: Any  # Int64: this rank's buffer
    call: Any  # Uint32: CALLS at the call's start; the call uses buffer call % 2
    failed: Any  # Int32: FAILED at the call's start; nonzero: wait for nothing, write NaN
    layout: Any  # MailboxLayout (static)
    timeout_ns: int  # static
    waiter: int  # static: the WAITERS code recorded if this wait gives up

    @property
    def buffer(self):
        return Int32(self.call & Uint32(1))

    @property
    def control(self):
        return self.mine + Int64(self.layout.control)


@cute.jit
def call_of(table: cute.Tensor, rank, layout: cutlass.Constexpr, timeout_ns: cutlass.Constexpr,
            waiter: cutlass.Constexpr = 0):
    """Rank `rank`'s Wait for the running call: its control words read once (CALLS, FAILED)."""
    mine = address_of(table, rank)
    words = load_words(mine + Int64(layout.control), strong=True)
    return Wait(table, mine, words[CONTROL.CALLS], Int32(words[CONTROL.FAILED]), layout,
                timeout_ns, waiter)


@cute.jit
def give_up(wait, peer):
    """Record that this rank's wait for rows of rank `peer` timed out, and mark every rank of
    the mailbox failed (their later waits stop, their kernels write NaN until a host re-arm)."""
    lay = wait.layout
    or_word(wait.mine + Int64(lay.word(CONTROL.MISSING)), Uint32(1) << Uint32(peer))
    store_word(wait.mine + Int64(lay.word(CONTROL.TIMED_OUT)), wait.call)
    store_word(wait.mine + Int64(lay.word(CONTROL.WAITER)), Uint32(wait.waiter))
    for q in cutlass.range_constexpr(lay.tp):
        store_word(address_of(wait.table, q) + Int64(lay.word(CONTROL.FAILED)), Uint32(1))


@cute.jit
def poll(address: Int64, wait, peer, first=None):
    """(four words, ok): the 16 bytes at `address` once none holds SENTINEL, polled with
    strong loads (`first`: the first poll's words, loaded by the caller). A bounded wait: it
    stops when `wait.timeout_ns` have passed (the global timer; then it records the timeout,
    `give_up`) or when the mailbox is marked failed (checked every 16 polls); it sleeps
    POLL_PAUSE_NS before each poll after the first. `ok` (Int32 1)
    only if the words landed in a call that started on a healthy mailbox; otherwise the
    caller writes NaN, never these words."""
    if cutlass.const_expr(first is None):
        first = load_words(address, strong=True)
    w0, w1, w2, w3 = first
    stop = wait.failed
    start = global_timer()
    spins = Int32(0)
    while is_armed([w0, w1, w2, w3]) & (stop == Int32(0)):
        pause(POLL_PAUSE_NS)
        w0, w1, w2, w3 = load_words(address, strong=True)
        spins = spins + 1
        if (spins & Int32(15)) == Int32(0):
            if global_timer() - start > Int64(wait.timeout_ns):
                stop = Int32(1)
            if load_word(wait.control + Int64(4 * CONTROL.FAILED)) != Uint32(0):
                stop = Int32(2)  # another rank gave up: stop, but record nothing
    landed = Int32(1) - Int32(is_armed([w0, w1, w2, w3]))
    if (stop == Int32(1)) & (landed == Int32(0)):
        give_up(wait, peer)
    return [w0, w1, w2, w3], landed * Int32(wait.failed == Int32(0))


@cute.jit
def poll_sum(slots: list, peers: list, wait, ahead: cutlass.Constexpr = None):
    """(eight fp32, ok): the bf16 rows at the `slots` addresses (published by ranks `peers`)
    summed in list (rank) order, each polled until it has landed (`poll`), so every reader of
    the same slots gets the same bits; NaN where any slot did not land (`ok` 0). While it
    checks a slot, the first polls of the `ahead` slots after it (None: of every slot) are in
    flight: where the rows have landed, the wait costs one memory round trip per ahead + 1
    slots, not one per slot (4 registers a slot in flight)."""
    depth = len(slots) if ahead is None else min(ahead + 1, len(slots))  # polls in flight
    firsts = [load_words(slots[i], strong=True) for i in range(depth)]
    words, ok = poll(slots[0], wait, peers[0], firsts[0])
    acc = words_to_f32(words)
    for i in cutlass.range_constexpr(1, len(slots)):
        if cutlass.const_expr(i + depth - 1 < len(slots)):
            firsts.append(load_words(slots[i + depth - 1], strong=True))
        words, landed = poll(slots[i], wait, peers[i], firsts[i])
        ok = ok * landed
        values = words_to_f32(words)
        acc = [a + v for a, v in zip(acc, values)]
    return poison_f32(acc, ok), ok


@cute.jit
def rearm(slots: list):
    """Write SENTINEL over the 16 bytes at each of the `slots` addresses (strong stores)."""
    for slot in slots:
        store_words(slot, [Uint32(SENTINEL)] * 4, strong=True)


@cute.jit
def arrive(table: cute.Tensor, ranks: cute.Tensor, layout: cutlass.Constexpr):
    """Called by one thread of each CTA of a call's last kernel once every thread of its CTA
    is done with CALLS (after a CTA barrier; FAILED may still be read): counts the CTA in
    ARRIVALS of the launch's first rank, a release, so those reads come first. Its result (the
    count before it) is `finish_call`'s; nothing waits for it until then."""
    return add_word(address_of(table, ranks[0]) + Int64(layout.word(CONTROL.ARRIVALS)),
                    Uint32(1))


@cute.jit
def finish_call(arrival, table: cute.Tensor, ranks: cute.Tensor, count: cutlass.Constexpr,
                layout: cutlass.Constexpr):
    """By the thread that `arrive`d, with its result, once every earlier kernel of the call has
    completed (`wait_for_previous`): the last CTA to arrive acquires every CTA's reads of the
    call counter (its arrival's atom, then an acquire fence), then advances the call counter of
    each of the launch's `count` ranks, so the next call on them uses the other buffer. The
    stores need no round trip, and no earlier store of the kernel need come first: the next
    call's kernels see them by the kernel boundary. (With acq_rel the fence's release half
    waited for the thread's own stores, the row's out and re-arms: 0.2-0.3 µs of a TP8 rank's
    tail, benchmarks/RESULTS.md, session 23.)"""
    gx, gy, gz = cute.arch.grid_dim()
    if arrival == Uint32(gx * gy * gz - 1):
        fence_acquire_gpu()
        store_word(address_of(table, ranks[0]) + Int64(layout.word(CONTROL.ARRIVALS)),
                   Uint32(0))
        for i in cutlass.range_constexpr(count):
            increment_word(address_of(table, ranks[i]) + Int64(layout.word(CONTROL.CALLS)))
