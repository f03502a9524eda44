"""The prebuilt kernel library (`ffi/`, built by `python -m jax_kimik3.native_build`): find
it, load it, read its manifest and register its XLA FFI handlers; imports no part of the
CuTe DSL, so a GPU host without the DSL runs the kernels from it.

The library exports, per kernel call `name` (jax_kimik3/kernels/launch.py names them),
`<name>_instantiate` (loads the kernel's cubin) and `<name>_execute` (launches it; command-
buffer compatible), and `jax_kimik3_manifest()`: JSON {"arch", "dsl", "sources", "calls":
{name: description}}. "sources" is the digest of the kernel sources it was built from: a
library whose digest differs from this package's is stale (launch.py will not use it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import pathlib

import jax

LIBRARY_ENV = "JAX_KIMIK3_LIBRARY"  # path of the library; default: DEFAULT_PATH
LIBRARY_NAME = "libjax_kimik3_kernels.so"
DEFAULT_DIR = pathlib.Path(__file__).resolve().parent.parent / "build" / "ffi"
DEFAULT_PATH = DEFAULT_DIR / LIBRARY_NAME
MANIFEST_SYMBOL = "jax_kimik3_manifest"
STAGES = ("instantiate", "execute")
PACKAGE = pathlib.Path(__file__).resolve().parent
# What a compiled kernel depends on: the kernels, their calls and the sizes they are built for.
KERNEL_SOURCES = ("kernels/*.py", "config.py", "mailbox.py")


@functools.cache
def source_digest() -> str:
    """sha256 of this package's kernel sources (KERNEL_SOURCES), in path order."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in KERNEL_SOURCES for p in PACKAGE.glob(pattern)):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class Library:
    """A loaded kernel library: its path, manifest and ctypes handle."""

    path: pathlib.Path
    arch: str
    dsl: str
    sources: str  # source_digest() where it was built
    calls: dict  # name → description
    handle: ctypes.CDLL

    @property
    def stale(self) -> bool:
        """Built from other kernel sources than this package's."""
        return self.sources != source_digest()

    @functools.cache
    def register(self) -> tuple[str, ...]:
        """Register every handler with XLA for CUDA (once, command-buffer compatible: a
        handler launches the same kernel every time); returns the targets' names."""
        from jaxlib.xla_client import CustomCallTargetTraits

        for name in self.calls:
            jax.ffi.register_ffi_target(
                name, {stage: jax.ffi.pycapsule(getattr(self.handle, f"{name}_{stage}"))
                       for stage in STAGES}, platform="CUDA", api_version=1,
                traits=CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
        return tuple(self.calls)


def library_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(LIBRARY_ENV) or DEFAULT_PATH)


@functools.cache
def load(path: pathlib.Path) -> Library:
    handle = ctypes.CDLL(str(path))
    manifest = getattr(handle, MANIFEST_SYMBOL)
    manifest.restype = ctypes.c_char_p
    info = json.loads(manifest())
    return Library(path, info["arch"], info["dsl"], info.get("sources", "unknown"), info["calls"],
                   handle)


def library() -> Library | None:
    """The library at $JAX_KIMIK3_LIBRARY (which must exist if set) or DEFAULT_PATH, if any."""
    path = library_path()
    if not path.exists():
        if os.environ.get(LIBRARY_ENV):
            raise FileNotFoundError(f"{LIBRARY_ENV}={path} does not exist")
        return None
    return load(path)
