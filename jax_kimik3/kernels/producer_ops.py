"""The o_proj producer as a kernel call inside jax.jit (kernels/producer.py has the kernel); this
module imports no part of the CuTe DSL."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels.geometry import TOKENS
from jax_kimik3.kernels.launch import Signature, Variant
from jax_kimik3.layout import MailboxSpec


def tiles(batch) -> int:
    """B tiles of TOKENS tokens that hold `batch` rows: what the producer is compiled for (it
    reads the batch itself at run time). By comparisons only, so a symbolic batch whose range
    lies within one tile count has it too (else jax raises: the range is too wide)."""
    capacity = KIMI_K3.mailbox_capacity
    if not 1 <= batch <= capacity:
        raise ValueError(f"o_proj producer: B={batch} must be in [1, {capacity}]")
    return next(t for t in range(1, capacity // TOKENS + 1) if batch <= t * TOKENS)


class Publish(NamedTuple):
    """Where a producer's rows go: the mailbox of `spec` (one-shot slots or two-shot owners)."""

    spec: MailboxSpec
    two_shot: bool


PROJECT = Signature(inputs=("x", "w"), outputs=("out",))  # producer.OprojProducer.__call__


def project(x, w, into=None):
    """bf16(x @ w.T) [B, N] on the producer kernel: x [B, K], w [N, K] bf16. `into`: a [B, N]
    buffer written in place (the GPU tests pass a poisoned one)."""
    b, k = x.shape
    n = w.shape[0]
    return PROJECT.call(Variant("oproj", (tiles(b), k, n)), dict(x=x, w=w),
                        {"out": jax.ShapeDtypeStruct((b, n), jnp.bfloat16)},
                        into=None if into is None else {"out": into})["out"]
