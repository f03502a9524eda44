"""Block AttnRes on a cluster of CTAs per token row (sm_90a), and its statistics producer.

A row's H = 7168 columns are split over a cluster of CLUSTER = 7 CTAs, each thread owning one
bf16 vector of them: 8 wide (128 threads per CTA) in a tail, whose mailbox words it polls;
STANDALONE_VECTOR wide in the standalone and statistics kernels. Per row:
1. the prefix update p = bf16(prefix + delta), stored to new_prefix (and to the block slot
   `write_idx` when the layer writes a block). With a mailbox `reduction` the delta (or, when
   a block starts, p itself) is the all-reduce of the TP ranks' o_proj rows: each thread polls
   its 8 columns in every rank's mailbox slot of the call's buffer, sums them in rank order,
   rounds to bf16 and re-arms the slots; after a two-shot reduction it polls the gather region
   instead, where the columns' owners left the sum (kernels/lamport.py has the protocol). R
   ranks per launch: cluster row `item` of R·B is rank item // B's token row item % B. A wait
   that gives up makes the whole row NaN (out and new_prefix): each thread's failure joins
   the logits' cluster exchange. Every CTA arrives once it has read the control words; the
   last, once the producers have completed, advances the ranks' call counters;
2. per source (the K saved blocks, then p) the partial Σv² and Σv·g·w of each thread, summed
   over the cluster through distributed shared memory (`primitives.cluster_sums`); in a tail
   the saved blocks' are summed over each warp before the poll, and p's, the failure and
   the blocks' pairs with p after it;
3. logits z = Σv·g·w · rsqrt(Σv²/H + eps), softmax, and the mix of the thread's 8 columns;
   with precomputed statistics only p is reduced, and mix = (c·acc + w_p·p) / (c·s + w_p);
4. the output RMSNorm: Σmix² over the cluster, then out = bf16(mix · rsqrt(Σmix²/H + eps) · g_out),
   or out = bf16(mix) without an output norm. Over few sources (GRAM_MAX_SOURCES) or
   precomputed statistics Σmix² needs no exchange of its own: step 2's exchange also sums each
   pair of sources' Σv_i·v_j (with statistics: Σmixture², Σmixture·p), and
   Σmix² = Σ_ij a_i a_j Σv_i·v_j (`mix_squares`); in a tail only where its kernel holds its
   sources across the poll.
The statistics producer runs steps 2-3 over the saved blocks alone and stores the unnormalised
fp32 mixture Σ e^{z_i-m} b_i and (m, s). Statistics ahead: the AttnRes kernel
also stores them for a later call site that mixes the same saved blocks under its own weights
(the next layer's pre-attention, or the final call), from the blocks it already holds and one
cluster exchange it already makes, so the later call reads no block.
Constraints: H = CLUSTER · threads · vector; 1 <= B (one cluster per row, grid (CLUSTER, R·B)).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64, Uint32

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels.variants import AttnResVariant
from jax_kimik3.kernels.geometry import (CLUSTER, FUSED_POLLS_AHEAD, GRAM_MAX_SOURCES,
                                         STANDALONE_CTAS_PER_SM, STANDALONE_VECTOR, VECTOR,
                                         WARP, cta_threads)
from jax_kimik3.layout import WAITER
from jax_kimik3.kernels.primitives import (arm_exchange, arrive, call_of, cluster_sums,
                                           dependent_launch,
                                           finish_call, load_f32, load_vector, no_nan,
                                           one_or_nan, poll_sum, prefetch, rearm,
                                           received_slots, store, vectors, wait_for_previous,
                                           warp_sums)

HIDDEN = KIMI_K3.hidden_size


def _row_major(*shape):
    stride, strides = 1, []
    for extent in reversed(shape):
        strides.append(stride)
        stride *= extent
    return cute.make_layout(shape, stride=tuple(reversed(strides)))


def _smem_bytes(reductions: int, values: int, warps: int) -> int:
    """Shared memory of `reductions` cluster_sums calls of `values` fp32 each by CTAs of
    `warps` warps, and their mbarriers."""
    return 4 * reductions * values * (warps + CLUSTER) + 8 * reductions + 64


@cute.jit
def source_partials(source, keys: list):
    """This thread's Σv² and, per key (g·w of its columns, eps), Σv·g·w of one source (its
    fp32 columns of a row): what the logits' exchange sums over the cluster (`logits_of`)."""
    partials = [(source * source).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)]
    for gw, _ in keys:
        partials.append((source * gw).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
    return partials


@cute.jit
def logits_of(source_sums: list, keys: list):
    """z = Σv·g·w · rsqrt(Σv²/H + eps) of each source under each key, from each source's
    cluster sums [Σv², Σv·g·w per key] (`source_partials` summed): [[z of each source] of each
    key]."""
    return [[sums[1 + k] * cute.math.rsqrt(sums[0] * (1.0 / HIDDEN) + eps)
             for sums in source_sums] for k, (_, eps) in enumerate(keys)]


@cute.jit
def pair_partials(sources: list):
    """This thread's Σv_i·v_j of each pair i < j of the sources (fp32 columns), in the order
    `mix_squares` reads them."""
    return [(sources[i] * sources[j]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for i in range(len(sources)) for j in range(i + 1, len(sources))]


def in_pair_order(blocks: list, with_p: list) -> list:
    """The pair sums of [b_0..b_{K-1}, p] in `pair_partials` order, from the saved blocks'
    own (`blocks`, that order) and each block's with p (`with_p`)."""
    pairs, among = [], iter(blocks)
    for i in range(len(with_p)):
        pairs += [next(among) for _ in range(i + 1, len(with_p))] + [with_p[i]]
    return pairs


@cute.jit
def mix_squares(weights: list, squares: list, pairs: list):
    """Σ mix² over the row of mix = Σ_i weights[i]·v_i, from the sources' Σv_i² and pair
    sums Σv_i·v_j (cluster sums): Σ_i w_i² Σv_i² + 2 Σ_{i<j} w_i w_j Σv_i·v_j, so the output
    norm needs no cluster exchange of its own."""
    total = Float32(0.0)
    pair = iter(pairs)
    for i in cutlass.range_constexpr(len(weights)):
        total = total + weights[i] * weights[i] * squares[i]
        for j in cutlass.range_constexpr(i + 1, len(weights)):
            total = total + 2.0 * weights[i] * weights[j] * next(pair)
    return total


@cute.jit
def maximum(values: list):
    top = values[0]
    for v in values[1:]:
        top = cute.arch.fmax(top, v)
    return top


@cute.jit
def store_statistics(z: list, blocks: cute.Tensor, row, col, mixture: cute.Tensor,
                     scal: cute.Tensor, item):
    """This thread's columns of Σ e^{z_i-m} b_i (of token row `row`) into row `item` of
    `mixture`, and (m, s) into `scal` from the row's first thread. Each block is read again
    (an L1 hit) rather than held in registers."""
    top = maximum(z)
    total = Float32(0.0)
    acc = None
    for i in cutlass.range_constexpr(len(z)):
        e = cute.math.exp(z[i] - top)
        total = total + e
        term = load_f32(blocks, (row, i, col)) * e
        acc = term if i == 0 else acc + term
    store(mixture, (item, col), acc)
    if col == 0:
        scal[item, 0] = top
        scal[item, 1] = total


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttnResTensors:
    """The tensors of one AttnRes kernel, by name; None: absent in this variant (a const_expr
    inside the kernel). Rows [R·B, H] out; the fused tail kernel passes its own."""

    prefix: Any
    delta: Any = None
    blocks: Any
    mixture: Any = None  # precomputed statistics (mixture [B, H], scal [B, 2])
    scal: Any = None
    res_norm_w: Any
    res_proj_w: Any
    out_norm_w: Any = None
    ahead_norm_w: Any = None  # a later site's weights: its statistics stored ahead
    ahead_proj_w: Any = None
    table: Any = None  # a mailbox reduction's peer table and ranks [R]
    ranks: Any = None
    out: Any
    new_prefix: Any = None
    ahead_mixture: Any = None
    ahead_scal: Any = None

    def vectors(self, width: int) -> AttnResTensors:
        """The same with every [.., H] tensor seen as `width`-element vectors (what `row`
        reads)."""
        return dataclasses.replace(self, **{
            name: vectors(getattr(self, name), width) for name in VECTOR_TENSORS
            if getattr(self, name) is not None})


VECTOR_TENSORS = ("prefix", "blocks", "res_norm_w", "res_proj_w", "out", "delta", "mixture",
                  "out_norm_w", "ahead_norm_w", "ahead_proj_w", "new_prefix", "ahead_mixture")


class AttnResKernel:
    """out, new_prefix (and the block write, in place) from prefix, delta (or the mailbox
    reduction of R ranks' rows), blocks, weights: rows [R·B, H] out."""

    def __init__(self, variant: AttnResVariant, *, capped: bool = False, holding: bool = False):
        """`capped`: the fused tail's row, under its register cap: fewer first polls in
        flight (FUSED_POLLS_AHEAD slots past the one it checks, not every slot's).
        `holding`: the kernel holds the saved blocks in registers from their first read to
        the mix, and in a tail the prefix and output-norm weight across the poll, rather than
        reading them from L1 again: the standalone kernel (within its register budget) and a
        tail's kernel over few rows per rank (tail.Tail)."""
        if holding and capped:
            raise ValueError("AttnRes kernel: holding=True is not for the fused tail's row "
                             "(capped=True): held, its inputs spill")
        self.v = variant
        self.ranks = variant.ranks
        # A tail's thread polls one mailbox word (VECTOR columns) of each slot.
        self.vector = VECTOR if variant.reduction is not None else STANDALONE_VECTOR
        self.threads = cta_threads(self.vector)
        self.warps = self.threads // WARP
        self.holding = holding
        self.polls_ahead = FUSED_POLLS_AHEAD if capped else None
        # One row per cluster, so one exchange per mbarrier: the exchanges land on mbarriers
        # (`cluster_sums(landed=)`). The fused tail runs row after row: cluster barriers.
        self.landing = not capped
        # The output norm's Σmix² from the logits' exchange (`mix_squares`), where every
        # source is still in registers when p is known (no poll comes between, or it holds)
        # and the pair sums are few (precomputed: two; else up to GRAM_MAX_SOURCES sources).
        self.one_exchange = (variant.out_norm and (variant.reduction is None or holding)
                             and (variant.precomputed or variant.sources <= GRAM_MAX_SOURCES))

    @cute.jit
    def __call__(self, stream, prefix: cute.Tensor, delta, blocks: cute.Tensor, mixture, scal,
                 res_norm_w: cute.Tensor, res_proj_w: cute.Tensor, out_norm_w, ahead_norm_w,
                 ahead_proj_w, table, ranks, out: cute.Tensor, new_prefix=None,
                 ahead_mixture=None, ahead_scal=None):
        """cutlass_call's order (attn_res_ops.SIGNATURE): inputs, then outputs."""
        self.launch(stream, AttnResTensors(
            prefix=prefix, delta=delta, blocks=blocks, mixture=mixture, scal=scal,
            res_norm_w=res_norm_w, res_proj_w=res_proj_w, out_norm_w=out_norm_w,
            ahead_norm_w=ahead_norm_w, ahead_proj_w=ahead_proj_w, table=table, ranks=ranks,
            out=out, new_prefix=new_prefix, ahead_mixture=ahead_mixture, ahead_scal=ahead_scal))

    @cute.jit
    def launch(self, stream, t: AttnResTensors):
        """The kernel on `stream`, one cluster per output row (R·B); the tail calls launch it
        after the rows' producers, and then it is their dependent launch: it reads its
        inputs and the saved blocks while they run and sums the rows as they land."""
        batch = cute.size(t.prefix, mode=[0])
        kernel = self.kernel(t.vectors(self.vector), batch)
        config = dict(grid=[CLUSTER, self.ranks * batch, 1], block=[self.threads, 1, 1],
                      cluster=[CLUSTER, 1, 1],
                      smem=_smem_bytes(1 if self.one_exchange else 2, self.exchanged,
                                       self.warps),
                      stream=stream)
        if cutlass.const_expr(self.v.reduction is not None):  # in a tail
            dependent_launch(kernel, **config)
        else:
            kernel.launch(min_blocks_per_mp=STANDALONE_CTAS_PER_SM,
                          preferred_smem_carveout=-1, **config)  # -1: no device query

    @property
    def exchanged(self) -> int:
        """Values per thread in the logits' cluster exchange: Σv² and one Σv·g·w per key of
        each source, with a reduction the thread's failure, and with one exchange the pair
        sums of what mix is made of (the sources; with statistics the mixture and p, and the
        mixture's Σ²)."""
        sources = self.v.sources
        pairs = 0
        if self.one_exchange:
            pairs = 2 if self.v.precomputed else sources * (sources - 1) // 2
        return (2 + self.v.ahead) * sources + (self.v.reduction is not None) + pairs

    @cute.kernel
    def kernel(self, t: AttnResTensors, batch: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, item, _ = cute.arch.block_idx()
        red = self.v.reduction
        wait, arrival = None, Uint32(0)
        if cutlass.const_expr(red is not None):
            # The control words first, while the producers run: CALLS cannot change before
            # the call's last kernel has arrived. This CTA is done with CALLS: it arrives now.
            wait = self.control_words(t, t.ranks[item // batch])
            cute.arch.barrier()
            if tidx == 0:
                arrival = arrive(t.table, t.ranks, red.spec.layout)
        self.row(tidx, cta, item, batch, t, wait)
        if cutlass.const_expr(red is not None):
            # The rows were polled as they landed; the call advances only once its producers
            # have completed, as at a kernel boundary.
            wait_for_previous()
            if tidx == 0:
                finish_call(arrival, t.table, t.ranks, self.ranks, red.spec.layout)

    @cute.jit
    def row(self, tidx, cta, item, batch, t: AttnResTensors, wait=None):
        """Thread `tidx` of cluster CTA `cta` on output row `item` (rank item // batch's
        token row; steps 1-4 of the module docstring), the tensors seen as vectors; with a
        reduction, `wait`: the control words already read (None: it reads them).
        Called by `threads` threads of each of the cluster's CLUSTER CTAs (it has CTA and
        cluster barriers: any other thread of the CTA must have exited); the fused tail
        kernel calls it too, row after row."""
        v = self.v
        col = cta * self.threads + tidx
        i = item // batch
        row = item - i * batch
        n = self.exchanged
        smem = cutlass.memory.SmemAllocator()
        warp_buf = smem.allocate_tensor(Float32, _row_major(self.warps, n), byte_alignment=16)
        cluster_buf = smem.allocate_tensor(Float32, _row_major(CLUSTER, n), byte_alignment=16)
        norm_warp, norm_cluster = None, None
        two_exchanges = v.out_norm and not self.one_exchange
        if cutlass.const_expr(two_exchanges):
            norm_warp = smem.allocate_tensor(Float32, _row_major(self.warps, 1),
                                             byte_alignment=16)
            norm_cluster = smem.allocate_tensor(Float32, _row_major(CLUSTER, 1),
                                                byte_alignment=16)
        landed, norm_landed = None, None  # one row per cluster: an mbarrier per exchange
        if cutlass.const_expr(self.landing):
            exchanges = 2 if two_exchanges else 1
            landed = smem.allocate_array(Int64, exchanges)
            if cutlass.const_expr(two_exchanges):
                norm_landed = landed + 1
            if tidx == 0:
                arm_exchange(landed, exchanges)
        cute.arch.cluster_arrive_relaxed()  # peers' shared memory must exist before DSMEM stores

        gw = load_f32(t.res_norm_w, col) * load_f32(t.res_proj_w, col)
        keys = [(gw, v.eps)]
        if cutlass.const_expr(v.ahead):
            keys.append((load_f32(t.ahead_norm_w, col) * load_f32(t.ahead_proj_w, col), v.eps))
        # The inputs are read here, before the cluster exchanges (and a tail's wait for its
        # rows), so no load waits behind a barrier; the saved blocks' partial sums too. What
        # is used again after the exchange (and a tail's poll) is held (bf16) in registers
        # when `holding` (read again, it costs a B <= 16 tail 0.1-0.7 µs and the standalone
        # kernel 0.07-0.25 µs: benchmarks/RESULTS.md), else read again from L1: that keeps a
        # tail's B = 64 grid in one wave, and the fused tail's row under its 64-register cap
        # (held, the prefix and output-norm weight spill 48 bytes at K = 8).
        saved, partials = [], []
        for s in cutlass.range_constexpr(v.sources - 1):
            saved.append(load_vector(t.blocks, (row, s, col)))
            partials.extend(source_partials(saved[-1].to(Float32), keys))
        # In a tail the exchange's values come in two runs: first what p does not change (the
        # saved blocks' partial sums, and with one exchange their pair sums), warp-summed into
        # `warp_buf` now, while the first polls are in flight; after the poll p's and the rest
        # (`cluster_sums(first=)`). With every warp sum after the poll, ptxas also sank the
        # partial sums' arithmetic there, onto the tail's critical path (a TP8 rank's split
        # tail is 0.1-0.2 µs faster this way at B = 1 and 16, level at 8, and the two-shot
        # tail 0.2 at B <= 16: benchmarks/RESULTS.md, session 23).
        gram = self.one_exchange and not v.precomputed  # with the pair sums of the sources
        early = partials
        if cutlass.const_expr(gram and v.reduction is not None):
            early = early + pair_partials([block.to(Float32) for block in saved])
        if cutlass.const_expr(v.reduction is not None):  # (the fused tail's last row is done
            warp_sums(early, warp_buf)  # with warp_buf: its exchange ended in a cluster barrier)
        prefix, delta, out_w, mixture, scal = None, None, None, None, None
        if cutlass.const_expr(self.holding and v.reduction is not None):  # across the poll
            if cutlass.const_expr(v.has_delta):
                prefix = load_vector(t.prefix, (row, col))
            if cutlass.const_expr(v.out_norm):
                out_w = load_vector(t.out_norm_w, col)
        if cutlass.const_expr(v.reduction is None):  # nothing comes between: held as fp32
            prefix = load_f32(t.prefix, (row, col))
            if cutlass.const_expr(v.has_delta):
                delta = load_f32(t.delta, (row, col))
            if cutlass.const_expr(v.out_norm):
                out_w = load_f32(t.out_norm_w, col)
        if cutlass.const_expr(v.precomputed):
            mixture, scal = load_f32(t.mixture, (row, col)), (t.scal[row, 0], t.scal[row, 1])
        extra = []
        if cutlass.const_expr(v.reduction is not None):
            if cutlass.const_expr(not self.holding):  # in L1 by the poll's end (no register held)
                if cutlass.const_expr(v.has_delta):
                    prefetch(t.prefix, (row, col))
                if cutlass.const_expr(v.out_norm):
                    prefetch(t.out_norm_w, col)
            if cutlass.const_expr(wait is None):
                wait = self.control_words(t, t.ranks[i])
            reduced, ok = self.reduced(wait, row, col)
            extra = [Float32(1.0) - Float32(ok)]  # this thread's failure, summed per row
            if cutlass.const_expr(v.has_delta):
                base = prefix.to(Float32) if self.holding else load_f32(t.prefix, (row, col))
                p = (base + reduced).to(cutlass.BFloat16).to(Float32)
            else:
                p = reduced
        else:
            p = prefix
            if cutlass.const_expr(v.has_delta):
                p = (p + delta).to(cutlass.BFloat16).to(Float32)
            if cutlass.const_expr(v.stores_prefix):
                store(t.new_prefix, (item, col), p)
        if cutlass.const_expr(v.write_idx >= 0):
            store(t.blocks, (row, v.write_idx, col), p)

        if cutlass.const_expr(self.one_exchange and v.precomputed):
            extra = extra + [(mixture * mixture).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                             (mixture * p).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)]
        elif cutlass.const_expr(gram and v.reduction is not None):  # the blocks' own: early
            extra = extra + [(block.to(Float32) * p).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                             for block in saved]
        elif cutlass.const_expr(gram):
            extra = extra + pair_partials([block.to(Float32) for block in saved] + [p])
        late = source_partials(p, keys) + extra
        # Completes the kernel's `cluster_arrive_relaxed` (peers' shared memory exists, they
        # are done with the last row's buffers) before the first DSMEM store.
        cute.arch.cluster_wait()
        if cutlass.const_expr(v.reduction is not None):
            sums = cluster_sums(late, warp_buf, cluster_buf, CLUSTER, cta, landed,
                                first=len(early))
        else:
            sums = cluster_sums(early + late, warp_buf, cluster_buf, CLUSTER, cta, landed)
        per = 1 + len(keys)  # Σv², then Σv·g·w per key, of each source
        source_sums = [sums[per * s: per * s + per] for s in range(v.sources - 1)]
        source_sums.append(sums[len(early): len(early) + per])  # p
        logits = logits_of(source_sums, keys)
        squares = [source[0] for source in source_sums]
        counted = 1 if v.reduction is not None else 0  # `extra`: the failure, then the pairs
        rest = sums[len(early) + per:]
        failures, pairs = rest[:counted], rest[counted:]
        if cutlass.const_expr(gram and v.reduction is not None):
            pairs = in_pair_order(sums[len(partials): len(early)], pairs)
        z = logits[0]
        scale = Float32(1.0)
        if cutlass.const_expr(v.reduction is not None):  # NaN over the whole row on a failure
            scale = one_or_nan(Int32(failures[0] == Float32(0.0)))
            store(t.new_prefix, (item, col), p * scale)

        if cutlass.const_expr(v.precomputed):
            m, s_saved = scal
            top = cute.arch.fmax(m, z[0])
            c, w_p = cute.math.exp(m - top), cute.math.exp(z[0] - top)
            total = c * s_saved + w_p
            mix = (mixture * c + p * w_p) * (1.0 / total)
            weights = [c, w_p]  # of the mixture and p
            if cutlass.const_expr(self.one_exchange):  # Σmixture², then Σmixture·p
                squares, pairs = [pairs[0], squares[0]], pairs[1:]
        else:
            top = maximum(z)
            e = cute.math.exp(z[v.num_blocks] - top)
            total, acc = e, p * e
            weights = []  # e^{z - top} of the blocks, then of p
            for s in cutlass.range_constexpr(v.num_blocks):
                weights.append(cute.math.exp(z[s] - top))
                total = total + weights[s]
                block = saved[s].to(Float32) if self.holding else load_f32(t.blocks, (row, s, col))
                acc = acc + block * weights[s]
            weights.append(e)
            mix = acc * (1.0 / total)

        if cutlass.const_expr(v.out_norm):
            if cutlass.const_expr(self.one_exchange):
                sq = mix_squares(weights, squares, pairs) * (1.0 / (total * total))
            else:
                sq = cluster_sums([(mix * mix).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)],
                                  norm_warp, norm_cluster, CLUSTER, cta, norm_landed)[0]
            r = cute.math.rsqrt(sq * (1.0 / HIDDEN) + v.out_eps)
            if cutlass.const_expr(v.reduction is not None):
                out_w = out_w.to(Float32) if self.holding else load_f32(t.out_norm_w, col)
            mix = mix * r * out_w
        if cutlass.const_expr(v.reduction is not None):
            mix = mix * scale
        store(t.out, (item, col), mix)
        if cutlass.const_expr(v.ahead):  # the later site's logits of the saved blocks (not p)
            store_statistics(logits[1][:v.num_blocks], t.blocks, row, col, t.ahead_mixture,
                             t.ahead_scal, item)

    @cute.jit
    def control_words(self, t: AttnResTensors, rank):
        """The Wait of the reduction's call: rank `rank`'s control words, read now."""
        red = self.v.reduction
        return call_of(t.table, rank, red.spec.layout, red.spec.timeout_ns,
                       WAITER.TAIL_CONSUMER)

    @cute.jit
    def reduced(self, wait, row, col):
        """(this thread's 8 columns of the rank-order fp32 sum of the TP mailbox slots of
        the call `wait`, rounded to bf16 (as fp32), ok): or of the gather region the two-shot
        owners filled with it; what was read is re-armed. NaN where the wait gave up (ok 0).
        In a tail it runs while the producers do: a Lamport slot holds the sentinel or this
        call's row, so each row is summed as soon as it lands."""
        slots, peers = received_slots(wait, row, col, two_shot=self.v.reduction.two_shot)
        acc, ok = poll_sum(slots, peers, wait, self.polls_ahead)
        if cutlass.const_expr(self.v.reduction.two_shot):
            # An owner that gave up sends NaN, and marks the mailbox failed where this thread
            # may not have looked yet: a NaN here is a failure of the row.
            ok = ok * no_nan(acc)
        rearm(slots)
        frag = cute.make_rmem_tensor(cute.make_layout(VECTOR), Float32)
        for e in cutlass.range_constexpr(VECTOR):
            frag[e] = acc[e]
        return frag.load().to(cutlass.BFloat16).to(Float32), ok


class StatisticsKernel:
    """mixture [B, H] f32 = Σ e^{z_i-m} b_i and scal [B, 2] f32 = (m, s) of blocks[:, :K]."""

    def __init__(self, num_blocks: int, eps: float):
        self.num_blocks, self.eps = num_blocks, eps
        self.threads = cta_threads(STANDALONE_VECTOR)
        self.warps = self.threads // WARP

    @cute.jit
    def __call__(self, stream, blocks: cute.Tensor, res_norm_w: cute.Tensor,
                 res_proj_w: cute.Tensor, mixture: cute.Tensor, scal: cute.Tensor):
        batch = cute.size(blocks, mode=[0])
        width = STANDALONE_VECTOR
        self.kernel(vectors(blocks, width), vectors(res_norm_w, width),
                    vectors(res_proj_w, width), vectors(mixture, width), scal).launch(
            grid=[CLUSTER, batch, 1], block=[self.threads, 1, 1],
            min_blocks_per_mp=STANDALONE_CTAS_PER_SM,
            preferred_smem_carveout=-1,  # the default (no device query)
            cluster=[CLUSTER, 1, 1], smem=_smem_bytes(1, 2 * self.num_blocks, self.warps),
            stream=stream)

    @cute.kernel
    def kernel(self, blocks: cute.Tensor, res_norm_w: cute.Tensor, res_proj_w: cute.Tensor,
               mixture: cute.Tensor, scal: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        col = rank * self.threads + tidx
        n = 2 * self.num_blocks
        smem = cutlass.memory.SmemAllocator()
        warp_buf = smem.allocate_tensor(Float32, _row_major(self.warps, n), byte_alignment=16)
        cluster_buf = smem.allocate_tensor(Float32, _row_major(CLUSTER, n), byte_alignment=16)
        landed = smem.allocate_array(Int64, 1)
        if tidx == 0:
            arm_exchange(landed)
        cute.arch.cluster_arrive_relaxed()
        keys = [(load_f32(res_norm_w, col) * load_f32(res_proj_w, col), self.eps)]
        partials = [source_partials(load_f32(blocks, (row, i, col)), keys)
                    for i in range(self.num_blocks)]
        cute.arch.cluster_wait()  # peers' shared memory exists
        sums = cluster_sums([value for source in partials for value in source], warp_buf,
                            cluster_buf, CLUSTER, rank, landed)
        z = logits_of([sums[2 * i: 2 * i + 2] for i in range(self.num_blocks)], keys)[0]
        store_statistics(z, blocks, row, col, mixture, scal, row)


@functools.cache
def attn_res_kernel(variant: AttnResVariant) -> AttnResKernel:
    """One kernel object per variant: cutlass_call's compile cache is keyed by it."""
    return AttnResKernel(variant, holding=True)


@functools.cache
def statistics_kernel(num_blocks: int, eps: float) -> StatisticsKernel:
    return StatisticsKernel(num_blocks, eps)
