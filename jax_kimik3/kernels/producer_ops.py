"""The o_proj producer as a kernel call inside jax.jit (kernels/producer.py has the kernel); this
module imports no part of the CuTe DSL."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kimik3.kernels.launch import Signature, Variant
from jax_kimik3.kernels.variants import tiles

PROJECT = Signature(inputs=("x", "w"), outputs=("out",))  # producer.OprojProducer.__call__


def project(x, w, into=None):
    """bf16(x @ w.T) [B, N] on the producer kernel: x [B, K], w [N, K] bf16. `into`: a [B, N]
    buffer written in place (the GPU tests pass a poisoned one)."""
    b, k = x.shape
    n = w.shape[0]
    return PROJECT.call(Variant("oproj", (tiles(b), k, n)), dict(x=x, w=w),
                        {"out": jax.ShapeDtypeStruct((b, n), jnp.bfloat16)},
                        into=None if into is None else {"out": into})["out"]
