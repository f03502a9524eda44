"""Which implementation runs a call: the CuTe DSL kernels or the pure-JAX reference."""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import jax

from jax_kimik3.config import KIMI_K3

Backend = Literal["auto", "kernel", "reference"]
BACKENDS = ("auto", "kernel", "reference")


@functools.cache
def dsl_available() -> bool:
    """Whether the CuTe DSL's JAX bridge can be imported."""
    return importlib.util.find_spec("cutlass") is not None


def use_kernels(backend: Backend, hidden: int) -> bool:
    """"kernel" forces the kernels (they compile for the GPU even where none is attached, e.g.
    to lower for CUDA on a CPU host); "auto" takes them on a GPU where they apply."""
    applies = hidden == KIMI_K3.hidden_size
    if backend == "kernel":
        if not applies:
            raise NotImplementedError(
                f"the kernels are built for H={KIMI_K3.hidden_size}; got H={hidden} "
                "(use backend='reference')")
        if not dsl_available():
            raise NotImplementedError("backend='kernel' needs nvidia-cutlass-dsl installed")
        return True
    return backend == "auto" and applies and jax.default_backend() == "gpu" and dsl_available()
