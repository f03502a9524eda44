"""Which implementation runs a call: the kernels or the pure-JAX reference; and where the
kernels come from: compiled at trace time by the CuTe DSL (JIT) or the prebuilt library (AOT)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Literal

import jax

from jax_kimik3 import native
from jax_kimik3.config import KIMI_K3

Backend = Literal["auto", "kernel", "reference"]
BACKENDS = ("auto", "kernel", "reference")
KernelMode = Literal["auto", "jit", "aot"]
KERNEL_MODES = ("auto", "jit", "aot")
KERNELS_ENV = "JAX_KIMIK3_KERNELS"  # auto (default): the library where it holds the kernel


def kernel_mode() -> KernelMode:
    """$JAX_KIMIK3_KERNELS: "jit" compiles every kernel with the CuTe DSL at trace time; "aot"
    takes every kernel from the prebuilt library (jax_kimik3.native) and fails for one it
    lacks; "auto" takes the library's kernels where it has them and JIT-compiles the rest."""
    mode = os.environ.get(KERNELS_ENV, "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r} must be one of {KERNEL_MODES}")
    return mode


@contextlib.contextmanager
def kernel_mode_set(mode: KernelMode):
    """Within it, kernel_mode() is `mode` (for traces that need one path, e.g. jax.export)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"mode={mode!r} must be one of {KERNEL_MODES}")
    before = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[KERNELS_ENV]
        else:
            os.environ[KERNELS_ENV] = before


@functools.cache
def dsl_available() -> bool:
    """Whether the CuTe DSL's JAX bridge can be imported."""
    return importlib.util.find_spec("cutlass") is not None


def kernels_available() -> bool:
    """Whether kernels can run in this kernel mode: the DSL (unless "aot") or the library
    (unless "jit")."""
    mode = kernel_mode()
    return ((mode != "aot" and dsl_available())
            or (mode != "jit" and native.library() is not None))


def use_kernels(backend: Backend, hidden: int) -> bool:
    """"kernel" forces the kernels (they compile for the GPU even where none is attached, e.g.
    to lower for CUDA on a CPU host); "auto" takes them on a GPU where they apply."""
    applies = hidden == KIMI_K3.hidden_size
    if backend == "kernel":
        if not applies:
            raise NotImplementedError(
                f"the kernels are built for H={KIMI_K3.hidden_size}; got H={hidden} "
                "(use backend='reference')")
        if not kernels_available():
            raise NotImplementedError(
                f"backend='kernel' needs nvidia-cutlass-dsl installed or, with "
                f"{KERNELS_ENV}={kernel_mode()}, the kernel library at {native.library_path()}")
        return True
    return (backend == "auto" and applies and jax.default_backend() == "gpu"
            and kernels_available())
