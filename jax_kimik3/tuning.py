"""Measured choices between kernel variants, kept in one place.

The o_proj producer kernel (kernels/producer.py, GEMM + publish in one kernel) against XLA's
dot followed by the Lamport publish kernel (~2 µs), from `examples/bench_layer.py` (oproj
part) on an H200 on 2026-11-29 (benchmarks/RESULTS.md): per rank's K, the batch range where
the producer is at least as fast. Outside it (K = 12288 at TP 1 everywhere; every K above
B = 16, where the producer re-reads x per 16 weight rows) XLA's dot wins.
"""

from __future__ import annotations

PRODUCER_BATCHES = {  # K per rank → (smallest B, largest B) where the producer wins
    6144: (2, 16),  # B = 1: 32.2 µs against 25.9 + 2
    3072: (1, 16),
    1536: (1, 16),
    768: (1, 16),
}


def use_producer(batch: int, k: int) -> bool:
    """Whether the tail's o_proj runs on the producer kernel (else XLA's dot + publish)."""
    low, high = PRODUCER_BATCHES.get(k, (1, 0))
    return low <= batch <= high


TWO_SHOT_BATCHES: dict[int, int] = {}  # TP → smallest B where the two-shot tail wins


def use_two_shot(batch: int, tp: int) -> bool:
    """Whether the tail's all-reduce runs two-shot (owners reduce column chunks) for `batch`
    rows at `tp` ranks (else one-shot)."""
    return tp in TWO_SHOT_BATCHES and batch >= TWO_SHOT_BATCHES[tp]
