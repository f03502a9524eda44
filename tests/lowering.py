"""Helpers of the CPU tests that lower kernels for CUDA (docs/kernels.md: the kernel bridge)."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall"  # what every kernel lowers to


def spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_cuda(f, *args):
    """The StableHLO text of jit(f) at `args`, lowered for CUDA on this (CPU) host."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kept_ptx(script, tmp_path, devices=1):
    """The PTX of every kernel that `script` compiles, run from the repository root in a fresh
    process (the DSL reads CUTE_DSL_KEEP and CUTE_DSL_DUMP_DIR once, at import) with
    `devices` host devices."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, check=True,
                   timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))


def entries(ptx):
    """(name, body) of every kernel entry in `ptx`."""
    for entry in re.split(r"\.entry ", ptx)[1:]:
        yield entry.split("(")[0], entry[entry.find("{"):]


def kernel_calls(f, *args):
    """The kernel calls (jax_kimik3.kernels.launch.Call) that lowering jit(f) at `args` makes,
    and the StableHLO text."""
    from jax_kimik3.kernels import launch

    calls = []
    with launch.recording(lambda call, fn, inputs: calls.append(call)):
        text = lower_for_cuda(f, *args)
    return calls, text
