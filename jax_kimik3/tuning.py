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

# K per rank → ((largest B, variant), ...) by increasing B; B past the last entry: "xla".
# fused to B = 4: "Tail variants" (TP2 mesh) and "Session 4" (virtual TP 4/8/16), 2026-11-29.
# split to B = 16: "o_proj producer kernel vs XLA's dot" (the producer at least as fast as
#   XLA's dot + publish at K <= 6144, B <= 16) and "Tail variants" (split from B = 8 on the
#   TP2 mesh), 2026-11-29. XLA's dot at K = 12288 (TP 1): the same producer section.
TAIL_VARIANTS: dict[int, tuple[tuple[int, TailVariant], ...]] = {
    6144: ((4, "fused"), (16, "split")),
    3072: ((4, "fused"), (16, "split")),
    1536: ((4, "fused"), (16, "split")),
    768: ((4, "fused"), (16, "split")),
}


def tail_variant(batch: int, k: int) -> TailVariant:
    """The tail's variant at B = `batch` rows and K = `k` columns of o_proj per rank."""
    for largest, variant in TAIL_VARIANTS.get(k, ()):
        if batch <= largest:
            return variant
    return "xla"


# TP → smallest B where the two-shot tail wins: "Tail variants" (virtual TP 8 and 16, B = 64),
# 2026-11-29; it loses at TP 2 ("Mailbox all-reduce on a real TP2 mesh").
TWO_SHOT_BATCHES = {8: 64, 16: 64}


def use_two_shot(batch: int, tp: int) -> bool:
    """Whether the tail's all-reduce runs two-shot (owners reduce column chunks) for `batch`
    rows at `tp` ranks (else one-shot)."""
    return tp in TWO_SHOT_BATCHES and batch >= TWO_SHOT_BATCHES[tp]
