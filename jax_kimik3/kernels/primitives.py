"""Shared CuTe DSL primitives: row vectors, CTA and cluster sums; this module defines no kernel."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_kimik3.mailbox import SENTINEL

NEG_ZERO_BF16 = 0x8000
VECTOR = 8  # bf16 elements per thread access ...
VECTOR_BYTES = 2 * VECTOR  # ... 16 bytes, four 32-bit words
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


# Lamport mailbox words: each helper takes a raw 64-bit global address (peer buffers are
# reached through the unified address space) and moves four 32-bit words = 8 bf16.

@dsl_user_op
def load_words(address: Int64, *, volatile: cutlass.Constexpr[bool] = False, loc=None, ip=None):
    """16 bytes at `address` as four Uint32. `volatile` (ld.volatile.global): every poll
    re-reads memory, never a register or L1 copy; the asm has side effects so a polling loop
    is not hoisted or merged."""
    opcode = "ld.volatile.global.v4.u32" if volatile else "ld.global.v4.u32"
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int64(address).ir_value(loc=loc, ip=ip)],
        f"{opcode} {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,l", has_side_effects=volatile,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def stream_words(address: Int64, *, loc=None, ip=None):
    """16 read-only bytes at `address` as four Uint32, streamed: a non-coherent load that
    skips L1 and asks L2 for the whole 256-byte line (weights read once per call)."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def mma_bf16(a, b, c, *, loc=None, ip=None):
    """One warp-wide `mma.sync.m16n8k16` (bf16 in, fp32 accumulate): D = A·B + C with this
    lane's fragments a (4 words), b (2 words), c (4 fp32); returns D's 4 fp32."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Uint32(w).ir_value(loc=loc, ip=ip) for w in (*a, *b)]
        + [Float32(v).ir_value(loc=loc, ip=ip) for v in c],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
        "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def store_words(address: Int64, words, *, loc=None, ip=None):
    """Weak st.global.v4.u32 of four words; a Lamport reader polls every word, so it needs no
    fence: a word either still holds SENTINEL or holds its final value."""
    llvm.inline_asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip)]
        + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
        "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def multicast_words(address: Int64, words, *, loc=None, ip=None):
    """`multimem.st.relaxed.sys.global.v4.f32` of four words at a multicast address: the same
    16 bytes land in every bound rank's buffer (raw bits; nothing is added)."""
    llvm.inline_asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip)]
        + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
        "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def store_word(address: Int64, word, *, loc=None, ip=None):
    """Weak st.global.u32 of one word."""
    llvm.inline_asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(word).ir_value(loc=loc, ip=ip)],
        "st.global.u32 [$0], $1;", "l,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _bits_to_f32(bits, *, loc=None, ip=None):
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


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


@cute.jit
def poll(address: Int64, max_spins: cutlass.Constexpr, status: Int64):
    """The four words at `address` once none holds SENTINEL. A bounded spin: after
    `max_spins` re-reads it stores 1 to the `status` word and returns what it has."""
    w0, w1, w2, w3 = load_words(address, volatile=True)
    spins = Int32(0)
    while is_armed([w0, w1, w2, w3]) & (spins < max_spins):
        w0, w1, w2, w3 = load_words(address, volatile=True)
        spins = spins + 1
    if spins >= max_spins:
        store_word(status, Uint32(1))
    return [w0, w1, w2, w3]


@cute.jit
def poll_sum(slots: list, max_spins: cutlass.Constexpr, status: Int64):
    """Eight fp32: the bf16 rows at the `slots` addresses summed in list (rank) order, each
    polled until it has landed (`poll`), so every reader of the same slots gets the same bits."""
    acc = words_to_f32(poll(slots[0], max_spins, status))
    for slot in slots[1:]:
        values = words_to_f32(poll(slot, max_spins, status))
        acc = [a + v for a, v in zip(acc, values)]
    return acc


@cute.jit
def rearm(slots: list):
    """Write SENTINEL over the 16 bytes at each of the `slots` addresses."""
    for slot in slots:
        store_words(slot, [Uint32(SENTINEL)] * 4)
