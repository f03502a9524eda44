"""Shared CuTe DSL primitives: row vectors, CTA and cluster sums; this module defines no kernel."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

VECTOR = 8  # bf16 elements per thread access: 16 bytes
WARP = 32


def vectors(tensor: cute.Tensor) -> cute.Tensor:
    """View a row-major tensor as (VECTOR-wide vectors, index of the vector); last mode split."""
    tile = (1,) * (cute.rank(tensor) - 1) + (VECTOR,)
    return cute.zipped_divide(tensor, tile)


@cute.jit
def load_f32(vecs: cute.Tensor, index):
    """The VECTOR elements of vector `index`, converted to fp32 (a TensorSSA)."""
    frag = cute.make_rmem_tensor(cute.size(vecs, mode=[0]), vecs.element_type)
    cute.autovec_copy(vecs[(None, index)], frag)
    return frag.load().to(Float32)


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
    address = Int32(local.toint(loc=loc, ip=ip))
    llvm.inline_asm(
        None,
        [address.ir_value(loc=loc, ip=ip), Int32(peer).ir_value(loc=loc, ip=ip),
         Float32(value).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1; "
        "st.shared::cluster.f32 [remote], $2; }",
        "r,r,f", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def cluster_sums(values: list, warp_buf: cute.Tensor, cluster_buf: cute.Tensor,
                 cluster_size: cutlass.Constexpr, rank):
    """Sum each per-thread fp32 in `values` over every thread of every CTA of the cluster.

    1. a butterfly warp sum; 2. lane 0 writes warp totals to `warp_buf` [warps, n];
    3. thread t < cluster_size adds them (fixed order) and stores the CTA total into slot
    `rank` of CTA t's `cluster_buf` [cluster_size, n] through distributed shared memory;
    4. a cluster barrier (arrive: release, wait: acquire) publishes the stores;
    5. every thread adds the slots in rank order, so all CTAs hold bitwise-equal sums.
    The caller must have synchronised the cluster once since launch (peers' shared memory
    exists), and gives each call its own `cluster_buf`.
    """
    n = len(values)
    warps = cute.size(warp_buf, mode=[0])
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    tidx, _, _ = cute.arch.thread_idx()
    for k in cutlass.range_constexpr(n):
        total = cute.arch.warp_reduction_sum(values[k])
        if lane == 0:
            warp_buf[warp, k] = total
    cute.arch.barrier()
    if tidx < cluster_size:
        for k in cutlass.range_constexpr(n):
            cta = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                cta = cta + warp_buf[w, k]
            store_to_peer_f32(cluster_buf.iterator + (rank * n + k), tidx, cta)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    sums = []
    for k in cutlass.range_constexpr(n):
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(cluster_size):
            acc = acc + cluster_buf[c, k]
        sums.append(acc)
    return sums
