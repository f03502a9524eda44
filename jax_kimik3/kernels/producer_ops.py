"""The o_proj producer as a kernel call inside jax.jit (kernels/producer.py has the kernel); this
module imports no part of the CuTe DSL."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kimik3.kernels.launch import Variant, launch
from jax_kimik3.mailbox import MailboxSpec


class Publish(NamedTuple):
    """Where a producer's rows go: the mailbox of `spec` (one-shot slots or two-shot owners)."""

    spec: MailboxSpec
    two_shot: bool


def project(x, w, into=None):
    """bf16(x @ w.T) [B, N] on the producer kernel: x [B, K], w [N, K] bf16. `into`: a [B, N]
    buffer written in place (the GPU tests pass a poisoned one)."""
    b, k = x.shape
    n = w.shape[0]
    return launch(Variant("oproj", (b, k, n)), jax.ShapeDtypeStruct((b, n), jnp.bfloat16),
                  {} if into is None else {2: 0})(x, w, *([] if into is None else [into]))
