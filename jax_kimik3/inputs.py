"""Random Kimi K3 tail inputs with a realistic spread, for tests, examples and benchmarks.

Saved blocks grow in norm block by block (b_0 is a small embedding), and the AttnRes
projection is scaled so that logits are of order 1-10: the softmax is far from uniform.
Arrays are NumPy bf16 (ml_dtypes); callers put them on devices.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from jax_kimik3.config import KIMI_K3

BF16 = ml_dtypes.bfloat16
LOGIT_STD = 4.0  # typical |z|: e^{±4} spreads the softmax weights over orders of magnitude


class AttnResInputs(NamedTuple):
    """One AttnRes call's arrays: prefix/delta [B, H], blocks [B, NB, H], weights [H] (a pytree)."""

    prefix: np.ndarray
    delta: np.ndarray
    blocks: np.ndarray
    res_norm_w: np.ndarray
    res_proj_w: np.ndarray
    out_norm_w: np.ndarray


def _bf16(a):
    return np.asarray(a, np.float32).astype(BF16)


def norm_weight(rng, hidden=KIMI_K3.hidden_size):
    """An RMSNorm gain: 1 ± 0.2."""
    return _bf16(1.0 + 0.2 * rng.standard_normal(hidden, np.float32))


def attn_res_inputs(rng, batch, num_saved=KIMI_K3.num_attn_res_blocks,
                    hidden=KIMI_K3.hidden_size) -> AttnResInputs:
    """Fresh inputs for one AttnRes call with `num_saved` block slots."""
    scales = 0.05 * 1.8 ** np.arange(num_saved, dtype=np.float32)  # b_0: the embedding
    blocks = rng.standard_normal((batch, num_saved, hidden), np.float32)
    blocks *= scales[None, :, None]
    proj_std = LOGIT_STD / np.sqrt(hidden * 1.04)  # Var(z) ≈ H·E[g²]·σ²
    return AttnResInputs(
        prefix=_bf16(2.0 * rng.standard_normal((batch, hidden), np.float32)),
        delta=_bf16(0.5 * rng.standard_normal((batch, hidden), np.float32)),
        blocks=_bf16(blocks),
        res_norm_w=norm_weight(rng, hidden),
        res_proj_w=_bf16(proj_std * rng.standard_normal(hidden, np.float32)),
        out_norm_w=norm_weight(rng, hidden),
    )


def oproj_inputs(rng, batch, k_total=KIMI_K3.o_proj_in_features, hidden=KIMI_K3.hidden_size):
    """(x [B, K] bf16, w [H, K] bf16) scaled so that x @ w.T has unit variance."""
    x = _bf16(rng.standard_normal((batch, k_total), np.float32))
    w = rng.standard_normal((hidden, k_total), np.float32)
    w *= 1.0 / np.sqrt(k_total)
    return x, _bf16(w)
