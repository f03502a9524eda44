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


def kernel_problem(hidden=None) -> str | None:
    """Why `backend="kernel"` cannot run here, or None. The kernels need a CUDA GPU; a host
    without one may still lower them for CUDA (tests, `jax.export`, the library's build):
    with CUTE_DSL_ARCH naming the GPU to compile for, or from the library (aot mode)."""
    if hidden is not None and hidden != KIMI_K3.hidden_size:
        return (f"the kernels are built for H={KIMI_K3.hidden_size}; got H={hidden} (use "
                "backend='reference')")
    if not kernels_available():
        return (f"needs nvidia-cutlass-dsl installed or, with {KERNELS_ENV}={kernel_mode()}, "
                f"the kernel library at {native.library_path()}")
    if (jax.default_backend() != "gpu" and not os.environ.get("CUTE_DSL_ARCH")
            and kernel_mode() != "aot"):
        return (f"needs a CUDA GPU (JAX's default backend here is {jax.default_backend()!r}); "
                "to lower the kernels for CUDA on this host, set CUTE_DSL_ARCH=sm_90a")
    return None


def use_kernels(backend: Backend, hidden: int) -> bool:
    """Whether a call runs the kernels: "kernel" (checked by `kernel_problem` first), or
    "auto" on a GPU where they apply."""
    if backend == "kernel":
        return True
    return (backend == "auto" and hidden == KIMI_K3.hidden_size
            and jax.default_backend() == "gpu" and kernels_available())
