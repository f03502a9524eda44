"""Decode steps ahead of time: `jax.export` with the kernels inside, and the kernels' XLA FFI
handlers registered on hosts without the CuTe DSL.

A lowered `cutlass_call` is the custom call `CuteDSLRT_NvJaxCutlassCall_v2`; its backend config
holds the whole compiled kernel (a host object with the sm_90a cubin inside) and its sha256.
So a step exported where the DSL compiled the kernels (a CPU host will do: kernels compile for
sm_90a there) carries every kernel it needs, and runs on a CUDA host whose XLA has that
target's handlers: they live in the DSL's runtime library (`libcute_dsl_runtime.so`, in the
`nvidia-cutlass-dsl-libs` wheels), the only part of the DSL such a host needs. Steps that use
mailboxes must take the peer table as an operand (`MailboxSpec` + `peer_table=`), since the
buffers' addresses belong to the process that runs the step.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax

from jax_kimik3 import backend

RUNTIME_ENV = "JAX_KIMIK3_DSL_RUNTIME"  # path of libcute_dsl_runtime.so on hosts without the DSL
FFI_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"  # what every kernel lowers to
FFI_TARGETS = {  # target → stage → symbol of the runtime library (cutlass/jax/ffi.py, v2)
    FFI_TARGET: {
        "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2",
        "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
        "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v2",
    },
}
FFI_TYPES = {"CuteDSLRT_NvJaxCutlassCallTypes_v2": {
    "type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
    "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2",
}}


def export(step, *args) -> jax.export.Exported:
    """`jax.export` of the jitted `step` for CUDA at the shapes and shardings of `args`
    (ShapeDtypeStructs or arrays); the kernels compile here, for sm_90a (JIT mode, whatever
    JAX_KIMIK3_KERNELS says: the artifact carries its kernels)."""
    import cutlass.jax

    with backend.kernel_mode_set("jit"):
        return jax.export.export(
            step, platforms=("cuda",),
            # The DSL's targets make no serialization-compatibility promise across its
            # versions: the runtime library that runs the step must come from the DSL that
            # exported it.
            disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*args)


def _symbol(library, name):
    function = getattr(library, name)
    function.restype = ctypes.c_void_p
    return function


@functools.cache
def register_runtime(library: str | None = None) -> str:
    """Register the kernels' FFI handlers with XLA (CUDA). With the DSL installed and no
    `library`, the DSL does it; otherwise from `library` or $JAX_KIMIK3_DSL_RUNTIME. Returns
    where the handlers came from."""
    library = library or os.environ.get(RUNTIME_ENV)
    if library is None:
        try:
            import cutlass.jax
        except ImportError:
            raise RuntimeError(
                f"no CuTe DSL here: set {RUNTIME_ENV} to the path of libcute_dsl_runtime.so "
                "(shipped with the exported step) or pass register_runtime(library)") from None
        cutlass.jax.register_ffi()
        return "the CuTe DSL"
    lib = ctypes.CDLL(library)
    for name, symbols in FFI_TYPES.items():
        jax.ffi.register_ffi_type(
            name, {stage: jax.ffi.pycapsule(_symbol(lib, symbol)())
                   for stage, symbol in symbols.items()}, platform="CUDA")
    for name, stages in FFI_TARGETS.items():
        jax.ffi.register_ffi_target(
            name, {stage: jax.ffi.pycapsule(_symbol(lib, symbol))
                   for stage, symbol in stages.items()}, platform="CUDA")
    return library


def load(serialized: bytes, library: str | None = None) -> jax.export.Exported:
    """An exported step, deserialized, with the kernels' handlers registered (`register_runtime`)."""
    register_runtime(library)
    return jax.export.deserialize(bytearray(serialized))
