"""Helpers of the CPU tests that lower kernels for CUDA (DESIGN.md §5)."""

import jax
import jax.numpy as jnp

CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall"  # what every kernel lowers to


def spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_cuda(f, *args):
    """The StableHLO text of jit(f) at `args`, lowered for CUDA on this (CPU) host."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
