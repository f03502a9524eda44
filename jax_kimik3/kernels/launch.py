"""The one dispatch point of every kernel call: `cutlass_call` (JIT) or the prebuilt library's
XLA FFI handler (AOT); this module imports no part of the CuTe DSL.

A call is named by its variant (the kernel family and its static parameters) and its
signature (which inputs are present, dtypes, ranks, aliases), never by its shapes: every
kernel takes its batch at run time, so one compiled object serves every batch (the o_proj
producer, specialised by batch, has it among its parameters). `kernel_mode()`
(jax_kimik3/backend.py) chooses the path; the library's build traces the kernel calls with
`recording` to compile each one as `cutlass_call` would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jax_kimik3 import backend, native

FACTORIES = {  # family → (module, function) that makes the CuTe DSL kernel object
    "attn_res": ("jax_kimik3.kernels.attn_res", "attn_res_kernel"),
    "statistics": ("jax_kimik3.kernels.attn_res", "statistics_kernel"),
    "all_reduce": ("jax_kimik3.kernels.lamport", "all_reduce_kernel"),
    "armed_check": ("jax_kimik3.kernels.lamport", "armed_check_kernel"),
    "oproj": ("jax_kimik3.kernels.producer", "producer_kernel"),
    "tail": ("jax_kimik3.kernels.tail", "tail_kernel"),
    "fused": ("jax_kimik3.kernels.fused", "fused_kernel"),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: its family (a key of FACTORIES) and static parameters."""

    family: str
    params: tuple

    def __post_init__(self):
        if self.family not in FACTORIES:
            raise ValueError(f"kernel family={self.family!r} is not one of {sorted(FACTORIES)}")

    def kernel(self):
        """The CuTe DSL kernel object (imports the DSL)."""
        module, factory = FACTORIES[self.family]
        return getattr(importlib.import_module(module), factory)(*self.params)


@dataclasses.dataclass(frozen=True)
class Call:
    """A variant with one argument signature: what one library handler implements."""

    variant: Variant
    inputs: tuple  # per input: None (absent) or (dtype, rank)
    outputs: tuple  # per output: (dtype, rank)
    aliases: tuple  # sorted (input index, output index); input indices count absent inputs

    @property
    def description(self) -> str:
        """Everything the compiled object depends on, readable (the library's manifest)."""
        return (f"{self.variant.family}{self.variant.params} inputs={self.inputs} "
                f"outputs={self.outputs} aliases={self.aliases}")

    @property
    def name(self) -> str:
        """The library's symbol and FFI target: k3_<family>_<hash of the description>."""
        digest = hashlib.sha256(self.description.encode()).hexdigest()[:16]
        return f"k3_{self.variant.family}_{digest}"


def _signature(x) -> tuple[str, int]:
    return np.dtype(x.dtype).name, len(x.shape)


def _describe(variant: Variant, inputs: Sequence[Any], outputs: Sequence[Any],
             aliases: dict[int, int]) -> Call:
    return Call(variant, tuple(None if x is None else _signature(x) for x in inputs),
                tuple(_signature(o) for o in outputs), tuple(sorted(aliases.items())))


_recorders: list[Callable] = []


@contextlib.contextmanager
def recording(record: Callable):
    """Within it, every JIT launch also calls record(call, cutlass_call_fn, inputs). JAX's
    caches are cleared first: a trace cached from before would make no launch to record."""
    jax.clear_caches()
    _recorders.append(record)
    try:
        yield
    finally:
        _recorders.remove(record)


def _from_library(call: Call) -> bool:
    """Whether `call` runs on the library's handler (registered here), per `kernel_mode()`."""
    mode = backend.kernel_mode()
    if mode == "jit":
        return False
    library = native.library()
    if library is not None and library.stale:
        message = (f"{library.path} was built from other kernel sources than this package's: "
                   "rebuild it (python -m jax_kimik3.native_build)")
        if mode == "aot":
            raise RuntimeError(f"{backend.KERNELS_ENV}=aot: {message}")
        warnings.warn(f"{message}; compiling the kernels instead", stacklevel=2)
        return False
    if library is not None and call.name in library.calls:
        library.register()
        return True
    if mode == "auto" and backend.dsl_available():
        return False
    where = "no library was found" if library is None else f"{library.path} does not hold it"
    if mode == "auto":
        where += " and the CuTe DSL (to compile it) is not installed"
    raise RuntimeError(
        f"{backend.KERNELS_ENV}={mode}: kernel {call.name} ({call.description}) is not "
        f"available: {where}. Build it (python -m jax_kimik3.native_build; see the README) "
        f"or set {backend.KERNELS_ENV}=jit")


@dataclasses.dataclass(frozen=True)
class Signature:
    """A kernel family's parameters by name, in the order its kernel object takes them after
    the stream: `inputs` (any may be absent: None), then `outputs`. `call` builds the
    positional `cutlass_call` from tensors by name; tests/test_kernel_lowering.py checks that
    each kernel object's parameters are these names."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def call(self, variant: Variant, inputs: dict, produce: dict, *, into: dict | None = None,
             updates: dict | None = None) -> dict:
        """Run `variant` on `inputs` (name → array; missing names are absent) and return its
        results by name: the outputs of `produce` (name → ShapeDtypeStruct), those written
        into the buffers of `into` (name → array; the first outputs, in order), and per
        `updates` (input name → result name) an input written in place."""
        into, updates = into or {}, updates or {}
        unknown = (set(inputs) - set(self.inputs)) | (set(produce) | set(into)) - set(self.outputs)
        if unknown or set(updates) - set(inputs):
            raise ValueError(f"{variant.family}: no parameter(s) {sorted(unknown)} among "
                             f"inputs {self.inputs} and outputs {self.outputs}")
        if list(into) != list(self.outputs[:len(into)]):
            raise ValueError(f"{variant.family}: into={sorted(into)} must be the first "
                             f"outputs of {self.outputs}")
        args = [inputs.get(name) for name in self.inputs]
        shapes, names, aliases = [], [], {}
        for name in self.outputs:
            if name in into:
                aliases[len(args)] = len(shapes)
                args.append(into[name])
            if name in produce:
                shapes.append(produce[name])
            elif name in into:
                shapes.append(jax.ShapeDtypeStruct(into[name].shape, into[name].dtype))
            else:
                continue
            names.append(name)
        for name, result in updates.items():
            aliases[self.inputs.index(name)] = len(shapes)
            shapes.append(jax.ShapeDtypeStruct(inputs[name].shape, inputs[name].dtype))
            names.append(result)
        return dict(zip(names, launch(variant, tuple(shapes), aliases)(*args)))


def launch(variant: Variant, output_shape_dtype, input_output_aliases=None):
    """Like `cutlass_call(kernel, output_shape_dtype=..., input_output_aliases=...)`: returns
    a function of the inputs (None for an absent one) that runs `variant` in the kernel mode.
    One ShapeDtypeStruct gives one result, a sequence a tuple."""
    aliases = dict(input_output_aliases or {})
    several = isinstance(output_shape_dtype, Sequence)
    outputs = tuple(output_shape_dtype) if several else (output_shape_dtype,)

    def call(*inputs):
        described = _describe(variant, inputs, outputs, aliases)
        if not _from_library(described):
            from cutlass.jax import cutlass_call

            fn = cutlass_call(variant.kernel(), output_shape_dtype=output_shape_dtype,
                              input_output_aliases=aliases)
            for record in _recorders:
                record(described, fn, inputs)
            return fn(*inputs)
        present = [i for i, x in enumerate(inputs) if x is not None]
        results = jax.ffi.ffi_call(
            described.name, outputs,
            input_output_aliases={present.index(i): o for i, o in aliases.items()})(
            *(inputs[i] for i in present))
        return tuple(results) if several else results[0]

    return call
