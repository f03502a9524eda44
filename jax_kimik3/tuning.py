"""Measured choices between kernel variants, kept in one place.

The post-attention tail (kernels/oproj.py) per (B, K per rank), one table:
- "xla": XLA's dot, then the Lamport publish kernel (~2 µs), then the AttnRes ring kernel;
- "split": the o_proj producer kernel (GEMM + publish), then the AttnRes ring kernel;
- "fused": producer and AttnRes consumer in one launch (kernels/oproj.OprojAttnResFused).
"split" against "xla" is measured: `examples/bench_layer.py` (oproj part) on an H200 on
2026-11-29 (benchmarks/RESULTS.md): the producer is at least as fast as XLA's dot + publish
for K <= 6144 up to B = 16 (not at B = 1 for K = 6144: 32.2 µs against 25.9 + 2); XLA's dot
wins at K = 12288 (TP 1) everywhere and at every K above B = 16 (the producer re-reads x per
16 weight rows).
"fused" is PROVISIONAL, NOT MEASURED: it is entered wherever "split" is measured to win up to
B = 8, on the argument that it saves one launch (~3 µs) and overlaps the consumer's launch
with the GEMM. Replace it with `examples/bench_layer.py --parts tail --variants fused,split`
(virtual TP on one GPU, the mesh on several).
"""

from __future__ import annotations

from typing import Literal

TailVariant = Literal["fused", "split", "xla"]
TAIL_VARIANT_NAMES = ("fused", "split", "xla")

TAIL_VARIANTS: dict[int, tuple[tuple[int, TailVariant], ...]] = {
    # K per rank → ((largest B, variant), ...) by increasing B; B past the last entry: "xla".
    # "fused" entries are provisional (see the docstring); "split"/"xla" bounds are measured.
    6144: ((1, "xla"), (8, "fused"), (16, "split")),
    3072: ((8, "fused"), (16, "split")),
    1536: ((8, "fused"), (16, "split")),
    768: ((8, "fused"), (16, "split")),
}


def tail_variant(batch: int, k: int) -> TailVariant:
    """The tail's variant at B = `batch` rows and K = `k` columns of o_proj per rank."""
    for largest, variant in TAIL_VARIANTS.get(k, ()):
        if batch <= largest:
            return variant
    return "xla"


def use_producer(batch: int, k: int) -> bool:
    """Whether the tail's o_proj runs on the producer kernel, alone or fused (else XLA's dot
    + publish)."""
    return tail_variant(batch, k) != "xla"


TWO_SHOT_BATCHES: dict[int, int] = {}  # TP → smallest B where the two-shot tail wins


def use_two_shot(batch: int, tp: int) -> bool:
    """Whether the tail's all-reduce runs two-shot (owners reduce column chunks) for `batch`
    rows at `tp` ranks (else one-shot)."""
    return tp in TWO_SHOT_BATCHES and batch >= TWO_SHOT_BATCHES[tp]
