"""Measured choices between kernel variants, kept in one place.

The post-attention tail (kernels/oproj.py) per (B, K per rank):
- "xla": XLA's dot, then the Lamport publish kernel, then the AttnRes consumer;
- "split": the o_proj producer kernel (GEMM + publish), then the AttnRes consumer;
- "fused": producer and AttnRes consumer in one persistent launch (kernels/fused.py);
and its all-reduce, one-shot or two-shot. Each entry names its measurement in
benchmarks/RESULTS.md, where the numbers are.
"""

from __future__ import annotations

from typing import Literal

TailVariant = Literal["fused", "split", "xla"]
TAIL_VARIANT_NAMES = ("fused", "split", "xla")

# K per rank → ((largest B, variant), ...) by increasing B; B past the last entry, or a K
# not here (K = 12288, TP 1): "xla".
# 1536 (TP 8): by what one rank of a mesh runs, "Session 7" (bench_rank: rank 0's own tail
#   call, the peers' rows delivered by ghost peers), 2026-12-01; measured again in "Session 9"
#   with the same choices (fused 0.5 µs ahead of xla at B = 32, within the spread); split again
#   in "Session 10" at B = 1, 8, 16; every variant in "Session 11", the same choices (at B = 32
#   four variants within 0.2 µs); split, two-shot and xla_two_shot at B = 1, 8, 16, 64 in
#   "Session 12", and split and xla_two_shot at B = 1, 8, 64 in "Session 14" (mbarrier
#   exchanges), the same choices. From B = 17 on: the producer kernel at every B since
#   "Session 19" (two row groups per producer CTA from B = 25: 3.1-4.6 µs ahead of the best
#   tail on XLA's dot at B = 24, 32, 48, 64).
# 6144 (TP 2): per rank in "Session 26", 2026-12-05: split 3.0-3.2 µs ahead of fused at B = 9
#   and 16 (fused had been chosen there in "Session 7"; an H100 agreed in "Sessions 24-25").
#   With the staged producer ("Session 31", 2026-12-06, H200) split is ahead of XLA's dot by
#   4.5 µs at B = 17 and 24 (XLA's dot had won at B = 17 against the streamed producer's
#   three B tiles in two waves) and 1.3 at B = 48; XLA's dot by 0.5 at B = 64. On wgmma
#   ("Session 38", 2026-12-07, H100) split is ahead of XLA's dot by 8.0 µs at B = 48 and 9.6
#   at B = 64 (45.79 against 55.40), and of two-shot by 3.8-4.3: the producer to B = 64, and
#   no entry runs XLA's dot. Fused is in no entry: `oproj_attn_res(variant="fused")` asks
#   for it.
# 3072 and 768 (TP 4, 16): whole virtual-TP groups, "Tail variants" and "Session 4", 2026-11-29
#   (the producer kernel to B = 16); per rank at B = 1, 2, 4 in "Session 22", where split is
#   2.5-4.8 µs ahead of fused (the groups had chosen fused there); at 3072 the producer kernel
#   at B = 25-32 per rank in "Session 19" (2.7 µs ahead of XLA's dot at B = 32; level at B = 24
#   and 48, 3 µs behind at 64). Past B = 16 per rank on an H100 in "Session 27", 2026-12-05,
#   and on an H200 at B = 17, 32, 64 in "Session 29", 2026-12-06, the same choices: at 3072
#   split ahead of XLA's dot at B = 17-32 (by 0.7-3.2 µs; at B = 32 two-shot), XLA's dot
#   ahead from B = 48 (by 1.5-5.1 µs on the H100, 2.4 of two-shot at B = 64 on the H200); at
#   768 the producer kernel two-shot ahead at every B from 17 to 64: by 1.7-6.1 µs of XLA's
#   dot two-shot, by 4.9-11.9 of the one-shot XLA's dot the table had at B = 17-48 (see
#   TWO_SHOT_BATCHES). With the staged producer ("Session 31") split two-shot at 3072 is
#   ahead of XLA's dot two-shot at B = 48 and 64 by 3.3 and 4.1 µs. XLA's dot at K = 12288
#   (TP 1): "o_proj producer kernel vs XLA's dot".
TAIL_VARIANTS: dict[int, tuple[tuple[int, TailVariant], ...]] = {
    6144: ((64, "split"),),
    3072: ((64, "split"),),
    1536: ((64, "split"),),
    768: ((64, "split"),),
}


def tail_variant(batch: int, k: int) -> TailVariant:
    """The tail's variant at B = `batch` rows and K = `k` columns of o_proj per rank."""
    for largest, variant in TAIL_VARIANTS.get(k, ()):
        if batch <= largest:
            return variant
    return "xla"


# TP → smallest B where the two-shot tail wins: "Tail variants" (virtual TP 8 and 16, B = 64),
# 2026-11-29; one TP 8 rank ("Session 19"): ahead of one-shot by 1.4-5.5 µs at B = 32-64, level
# at B = 24, where the cost model's NVLink time (1.3 against 5.4 µs) decides, unmeasured on a
# mesh; it loses at TP 2 ("Mailbox all-reduce on a real TP2 mesh"). One TP 16 rank on an H100
# ("Session 27"): ahead of one-shot by 1.6-13.4 µs at B = 16-64, 0.3-1.5 µs behind at B = 1-8
# (where the NVLink time, 0.5-3.8 µs one-shot against 0.1-0.5, would narrow or turn it); on an
# H200 ("Session 29") ahead by 2.1-10.0 µs at B = 17, 32, 64. One TP 4 rank: the split tail
# two-shot ahead of one-shot at B = 32 on an H100 (2.0 µs, "Session 27") and an H200 (0.8,
# "Session 29"), behind at B = 17-24 (1.0-1.9); at B = 48-64 two-shot is 0.3-0.6 µs behind on
# XLA's dot, and 0.7-2.1 behind with the staged producer ("Session 31"), where the NVLink time
# (4.6-6.1 µs one-shot against 2.3-3.1) decides, as at TP 8.
TWO_SHOT_BATCHES = {4: 32, 8: 24, 16: 16}


def use_two_shot(batch: int, tp: int) -> bool:
    """Whether the tail's all-reduce runs two-shot (owners reduce column chunks) for `batch`
    rows at `tp` ranks (else one-shot)."""
    return tp in TWO_SHOT_BATCHES and batch >= TWO_SHOT_BATCHES[tp]
