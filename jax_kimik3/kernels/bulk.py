"""Bulk copies from global into shared memory (sm_90 `cp.async.bulk`) and the mbarriers that
count their bytes; this module defines no kernel.

A stage of shared memory is filled by one thread: it arms the stage's mbarrier with the bytes
it will copy (`expect_bytes`), then issues the copies (`copy_in`); the copy engine completes
the bytes on the mbarrier, and every thread that needs the stage waits for the mbarrier's
phase (`wait_phase`). Shared memory is addressed by its 32-bit shared-window address
(`shared_address`).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result, args, text, constraints, *, loc, ip):
    return llvm.inline_asm(result, args, text, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
                           ip=ip)


@dsl_user_op
def shared_address(pointer: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """The 32-bit shared-window address of a shared-memory pointer."""
    return Int32(pointer.toint(loc=loc, ip=ip))


@dsl_user_op
def init_barrier(barrier: Int32, *, loc=None, ip=None):
    """Initialise the mbarrier at `barrier` for one arrival per phase (the filling thread's)."""
    _asm(None, [Int32(barrier).ir_value(loc=loc, ip=ip)],
         "mbarrier.init.shared::cta.b64 [$0], 1;", "r", loc=loc, ip=ip)


@dsl_user_op
def fence_barrier_init(*, loc=None, ip=None):
    """Make this thread's mbarrier initialisations visible to the copy engine; a CTA barrier
    after it makes them visible to the other threads."""
    _asm(None, [], "fence.mbarrier_init.release.cluster;", "", loc=loc, ip=ip)


@dsl_user_op
def fence_async_shared(*, loc=None, ip=None):
    """Order this CTA's earlier shared-memory reads (made visible to this thread by a CTA
    barrier) before the bulk copies it issues next into the same bytes."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", loc=loc, ip=ip)


@dsl_user_op
def expect_bytes(barrier: Int32, count, *, loc=None, ip=None):
    """Arrive on the mbarrier at `barrier`, its phase now completing once `count` bytes land."""
    _asm(None, [Int32(barrier).ir_value(loc=loc, ip=ip), Int32(count).ir_value(loc=loc, ip=ip)],
         "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r", loc=loc, ip=ip)


@dsl_user_op
def evict_first(*, loc=None, ip=None) -> Int64:
    """An L2 policy that evicts these lines first: for data streamed once (the o_proj weight),
    so what is read again (x, the mailbox) stays in L2."""
    return Int64(_asm(T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;",
                      "=l", loc=loc, ip=ip))


@dsl_user_op
def copy_in(destination: Int32, source: Int64, count, barrier: Int32, policy: Int64, *,
            loc=None, ip=None):
    """Copy `count` bytes (a multiple of 16, both addresses 16-byte aligned) from global
    `source` to shared `destination`, completing them on the mbarrier at `barrier`, under the
    L2 `policy`."""
    _asm(None, [Int32(destination).ir_value(loc=loc, ip=ip),
                Int64(source).ir_value(loc=loc, ip=ip), Int32(count).ir_value(loc=loc, ip=ip),
                Int32(barrier).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
         "[$0], [$1], $2, [$3], $4;", "r,l,r,r,l", loc=loc, ip=ip)


@dsl_user_op
def wait_phase(barrier: Int32, phase, *, loc=None, ip=None):
    """Wait until the mbarrier at `barrier` has completed phase parity `phase` (its bytes have
    landed). A bulk copy of mapped global memory always completes, so the wait ends."""
    _asm(None, [Int32(barrier).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
         "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
         "@!done bra WAIT; }", "r,r", loc=loc, ip=ip)


@dsl_user_op
def load_shared(address: Int32, *, loc=None, ip=None):
    """16 bytes of shared memory at `address` as four Uint32; ordered after the `wait_phase`
    before it (both are volatile asm: the compiler keeps their order)."""
    out = _asm(llvm.StructType.get_literal([T.i32()] * 4), [Int32(address).ir_value(loc=loc, ip=ip)],
               "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(4)]
