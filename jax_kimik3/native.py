"""The prebuilt kernel library (`ffi/`, built by `python -m jax_kimik3.native_build`): find
it, load it, read its manifest and register its XLA FFI handlers; imports no part of the
CuTe DSL, so a GPU host without the DSL runs the kernels from it.

The library exports, per kernel call `name` (jax_kimik3/kernels/launch.py names them),
`<name>_instantiate` (loads the kernel's cubin) and `<name>_execute` (launches it; command-
buffer compatible), and `jax_kimik3_manifest()`: JSON {"arch", "dsl", "sources", "calls":
{name: description}}. "sources" is the digest of the code of the kernel sources it was built
from (`source_digest`; docstrings and comments aside): a library whose digest differs from
this package's is stale (launch.py will not use it).
"""

from __future__ import annotations

import ast
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


def kernel_sources() -> list[pathlib.Path]:
    """What a compiled kernel depends on: the modules that make the CuTe DSL kernel objects
    (kernels/launch.py's FACTORIES) and every module of this package they import, in turn."""
    from jax_kimik3.kernels.launch import FACTORIES

    todo = sorted({module for module, _ in FACTORIES.values()})
    found = {}
    while todo:
        module = todo.pop()
        path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        if module in found or not path.exists():
            continue
        found[module] = path
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            todo += [n for n in names if n.split(".")[0] == PACKAGE.name]
    return sorted(found.values())


def _code(source: str) -> str:
    """`source` as its syntax tree without docstrings: comments, docstrings, layout and the
    Python version that parses it do not change what the DSL compiles, nor the digest."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _dump(tree)


def _dump(node) -> str:
    """A syntax tree as text without its None and empty fields: Python versions add such
    fields (3.12 `type_params=[]`) or leave them out of `ast.dump` (3.13), and a library built
    under one version must not look stale under another."""
    if isinstance(node, ast.AST):
        fields = ((name, _dump(getattr(node, name, None))) for name in node._fields)
        shown = ",".join(f"{name}={text}" for name, text in fields if text not in ("None", "[]"))
        return f"{type(node).__name__}({shown})"
    if isinstance(node, list):
        return f"[{','.join(map(_dump, node))}]"
    return repr(node)


@functools.cache
def source_digest() -> str:
    """sha256 of the code of `kernel_sources()`, in path order."""
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0"
                      + _code(path.read_text()).encode())
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
def load_library(path: pathlib.Path) -> Library:
    try:
        handle = ctypes.CDLL(str(path))
        manifest = getattr(handle, MANIFEST_SYMBOL)
    except (OSError, AttributeError) as e:
        where = f"{LIBRARY_ENV}={path}" if os.environ.get(LIBRARY_ENV) else str(path)
        raise RuntimeError(f"{where} is not the kernel library (python -m "
                           f"jax_kimik3.native_build makes it): {e}") from None
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
    return load_library(path)
