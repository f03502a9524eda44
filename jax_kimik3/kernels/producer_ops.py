"""The o_proj producer as kernel calls inside jax.jit (kernels/producer.py has the kernel); this
module imports no part of the CuTe DSL."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kimik3.kernels.launch import Variant, launch
from jax_kimik3.mailbox import MailboxLayout


class Publish(NamedTuple):
    """Where the rows go: the mailbox slots of `parity` (one-shot, or two-shot owners)."""

    layout: MailboxLayout
    parity: int
    two_shot: bool
    multicast: bool


def project(x, w, into=None):
    """bf16(x @ w.T) [B, N] on the producer kernel: x [B, K], w [N, K] bf16. `into`: a [B, N]
    buffer written in place (the GPU tests pass a poisoned one)."""
    b, k = x.shape
    n = w.shape[0]
    return launch(Variant("oproj", (b, k, n, None)), jax.ShapeDtypeStruct((b, n), jnp.bfloat16),
                  {} if into is None else {5: 0})(
        x, w, None, None, None, *([] if into is None else [into]))


def produce(x, w, table, rank, *, layout, parity, two_shot=False, multicast=False, after=None):
    """This rank's o_proj rows bf16(x @ w.T), published into the mailbox slots at `parity`;
    returns the int32 [1] token (as `lamport_ops.publish`)."""
    b, k = x.shape
    publish = Publish(layout, parity, two_shot, multicast)
    return launch(Variant("oproj", (b, k, w.shape[0], publish)),
                  jax.ShapeDtypeStruct((1,), jnp.int32))(
        x, w, table, rank, x if after is None else after)
