"""Measured choices between kernel variants, kept in one place.

The post-attention tail (kernels/oproj.py) per (B, K per rank), one table:
- "xla": XLA's dot, then the Lamport publish kernel (~2 µs), then the AttnRes ring kernel;
- "split": the o_proj producer kernel (GEMM + publish), then the AttnRes ring kernel;
- "fused": producer and AttnRes consumer in one launch (kernels/oproj.OprojAttnResFused).
Every entry is measured (benchmarks/RESULTS.md, H200s, 2026-11-29):
- "split" against "xla": `examples/bench_layer.py` oproj part, one GPU: the producer is at
  least as fast as XLA's dot + publish for K <= 6144 up to B = 16; XLA's dot wins at
  K = 12288 (TP 1) everywhere and at every K above B = 16 (the producer re-reads x per 16
  weight rows).
- "fused" against "split" and "xla": `bench_layer.py --parts tail --variants fused,split,xla`
  on a TP2 mesh (K = 6144): fused 44.0 / 43.6 µs at B = 1 / 4 against split 49.9 / 44.6 and
  xla 54.7 / 53.7; split wins from B = 8 (43.4 against 46.7). At TP >= 4 (K <= 3072), in
  virtual TP on one GPU (no 4- or 8-GPU machine lent): fused 54.1 / 56.8 µs at B = 1 / 4
  against split 70.7 / 62.9 (TP 4), 54.0 / 58.0 against 73.8 / 76.6 (TP 8), 56.5 / 69.5
  against 101.4 / 108.3 (TP 16). Virtual TP still favours fused at B = 8 (58.4 against 64.2
  at TP 4), where the one mesh measured favours split: those keep split until a mesh says.
- two-shot against one-shot: `--variants split,two_shot` in virtual TP on one GPU (every
  rank's traffic on one GPU's memory, not NVLink): two-shot wins at B = 64 for TP 8 (195.8
  against 215.4 µs per TP group) and TP 16 (298.0 against 356.6), loses at B = 33 and at
  TP 2 (the TP2 mesh all-reduce: 10-12 µs against 8-9 one-shot at every B).
"""

from __future__ import annotations

from typing import Literal

TailVariant = Literal["fused", "split", "xla"]
TAIL_VARIANT_NAMES = ("fused", "split", "xla")

TAIL_VARIANTS: dict[int, tuple[tuple[int, TailVariant], ...]] = {
    # K per rank → ((largest B, variant), ...) by increasing B; B past the last entry: "xla".
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


def use_producer(batch: int, k: int) -> bool:
    """Whether the tail's o_proj runs on the producer kernel, alone or fused (else XLA's dot
    + publish)."""
    return tail_variant(batch, k) != "xla"


TWO_SHOT_BATCHES = {8: 64, 16: 64}  # TP → smallest B where the two-shot tail wins


def use_two_shot(batch: int, tp: int) -> bool:
    """Whether the tail's all-reduce runs two-shot (owners reduce column chunks) for `batch`
    rows at `tp` ranks (else one-shot)."""
    return tp in TWO_SHOT_BATCHES and batch >= TWO_SHOT_BATCHES[tp]
