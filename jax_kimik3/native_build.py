"""Build the kernel library (`ffi/`): every call of the catalog (jax_kimik3/kernels/catalog.py)
compiled ahead of time for sm_90a, each behind XLA FFI handlers, in one shared library.

    python -m jax_kimik3.native_build [--tp 2,8] [--layers 93] [--out build/ffi]

Needs the CuTe DSL, the CUDA toolkit (static runtime and headers), CMake and a C++ compiler;
no GPU. Steps:
1. trace every catalog entry with the kernels in JIT mode, recording each kernel call's
   `cutlass_call` (kernels/launch.py): its kernel object and argument spec;
2. compile each distinct call as `cutlass_call` would (its `jit_wrapper`, the batch
   symbolic) and `export_to_c` it: <out>/gen/<name>.o and .h;
3. write the handlers (<out>/gen/handlers_*.cc, on ffi/k3_handler.h) and the manifest;
4. CMake links <out>/libjax_kimik3_kernels.so with the static CUDA and DSL runtimes.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when the DSL is imported

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jax_kimik3 import backend, native  # noqa: E402
from jax_kimik3.config import KIMI_K3  # noqa: E402
from jax_kimik3.kernels import catalog, launch  # noqa: E402

ARCH = os.environ["CUTE_DSL_ARCH"]
SOURCE_DIR = pathlib.Path(__file__).resolve().parent.parent / "ffi"
HANDLERS_PER_FILE = 32  # generated handler sources are compiled in parallel


def record_calls(tps, num_layers) -> dict:
    """name → (launch.Call, kernel object, cutlass.jax FunctionSpec) of every catalog call."""
    calls = {}

    def record(call, fn, inputs):
        if call.name in calls:
            return
        specs = [None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        found = [e for e in _equations(jax.make_jaxpr(fn)(*specs).jaxpr)
                 if e.primitive.name == "cutlass_call_inner"]
        if len(found) != 1:
            raise RuntimeError(f"{call.name}: expected one cutlass_call, found {len(found)}")
        calls[call.name] = (call, found[0].params["lowering_target"].fn, found[0].params["spec"])

    # The DSL's calls, whatever library exists already.
    with backend.kernel_mode_set("jit"), launch.recording(record):
        for _, function, args in catalog.decode_calls(tps, num_layers):
            jax.make_jaxpr(function)(*args)
    return calls


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from _equations(getattr(inner, "jaxpr", inner))


def export_object(name, fn, spec, gen: pathlib.Path):
    """<gen>/<name>.o and .h: the call compiled as cutlass_call compiles it."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.jax.compile import jit_wrapper

    options = {"options": spec.compile_options} if spec.compile_options else {}
    compiled = cute.compile(jit_wrapper, cuda.CUstream(0), *spec.get_compile_args(),
                            wrapped_fn=fn, spec=spec, **options)
    compiled.export_to_c(file_path=str(gen), file_name=name, function_prefix=name)


def handler_source(names_buffers) -> str:
    """C++ of the handlers of [(name, buffers)]."""
    lines = ['#include "k3_handler.h"', ""]
    lines += [f'#include "{name}.h"' for name, _ in names_buffers]
    for name, buffers in names_buffers:
        args = ", ".join(f"&d[{i}]" for i in range(buffers))
        lines += [
            "",
            f"static {name}_Kernel_Module_t {name}_module;",
            f"static void {name}_load() {{ {name}_Kernel_Module_Load(&{name}_module); }}",
            f"static int32_t {name}_run(cudaStream_t s, k3::Descriptor* d) {{",
            f"  return cute_dsl_{name}_wrapper(&{name}_module, s, {args});",
            "}",
            f'static k3::Kernel {name}_kernel{{"{name}", {buffers}, &{name}_load, &{name}_run}};',
            f"XLA_FFI_DEFINE_HANDLER_SYMBOL({name}_instantiate, k3::Instantiate{{&{name}_kernel}},",
            "                              k3::InstantiateBinding());",
            f"XLA_FFI_DEFINE_HANDLER_SYMBOL({name}_execute, k3::Execute{{&{name}_kernel}},",
            "                              k3::ExecuteBinding(),",
            "                              {xla::ffi::Traits::kCmdBufferCompatible});",
        ]
    return "\n".join(lines) + "\n"


def manifest_source(manifest: dict) -> str:
    text = json.dumps(manifest, sort_keys=True)
    return ('extern "C" const char* ' + native.MANIFEST_SYMBOL + "() {\n  return R\"k3("
            + text + ')k3";\n}\n')


def dsl_lib_dir() -> pathlib.Path:
    """The DSL wheel's lib/ with libcuda_dialect_runtime_static.a."""
    import cutlass
    root = pathlib.Path(cutlass.__file__).resolve().parents[2]
    found = sorted(root.glob("cu*/lib/libcuda_dialect_runtime_static.a"))
    if not found:
        raise RuntimeError(f"no libcuda_dialect_runtime_static.a under {root}/cu*/lib")
    return found[-1].parent


def build(tps, num_layers, out: pathlib.Path, jobs: int) -> dict:
    """Generate, compile and link; returns the timings, counts and size."""
    if not (SOURCE_DIR / "CMakeLists.txt").is_file():
        raise FileNotFoundError(
            f"the library's sources ({SOURCE_DIR}/CMakeLists.txt) are absent: ffi/ is not "
            "installed with the package; build from a source checkout or an editable install")
    start = time.perf_counter()
    gen = out / "gen"
    shutil.rmtree(gen, ignore_errors=True)
    gen.mkdir(parents=True)
    calls = record_calls(tps, num_layers)
    traced = time.perf_counter()
    for name, (_, fn, spec) in sorted(calls.items()):
        export_object(name, fn, spec, gen)
    exported = time.perf_counter()
    items = sorted((name, len(spec.in_args) + len(spec.out_args))
                   for name, (_, _, spec) in calls.items())
    for i in range(0, len(items), HANDLERS_PER_FILE):
        (gen / f"handlers_{i // HANDLERS_PER_FILE:03d}.cc").write_text(
            handler_source(items[i:i + HANDLERS_PER_FILE]))
    manifest = {"arch": ARCH, "dsl": importlib.metadata.version("nvidia-cutlass-dsl"),
                "sources": native.source_digest(), "tp": list(tps), "layers": num_layers,
                "calls": {name: call.description for name, (call, _, _) in calls.items()}}
    (gen / "handlers_manifest.cc").write_text(manifest_source(manifest))
    cmake = out / "cmake"
    subprocess.run(["cmake", "-S", str(SOURCE_DIR), "-B", str(cmake), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", f"-DK3_GENERATED={gen}",
                    f"-DK3_XLA_FFI_INCLUDE={jax.ffi.include_dir()}",
                    f"-DK3_CUTE_DSL_LIB={dsl_lib_dir()}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(cmake), "-j", str(jobs)], check=True,
                   stdout=subprocess.DEVNULL)
    library = out / native.LIBRARY_NAME
    shutil.copy2(cmake / native.LIBRARY_NAME, library)
    shutil.rmtree(cmake)  # what ships is the library alone
    shutil.rmtree(gen)
    end = time.perf_counter()
    return {"calls": len(calls), "trace_s": traced - start, "export_s": exported - traced,
            "link_s": end - exported, "total_s": end - start,
            "mib": library.stat().st_size / 2**20, "path": str(library)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default=",".join(map(str, catalog.TP_VALUES)),
                        help="comma-separated TP values (default: all)")
    parser.add_argument("--layers", type=int, default=KIMI_K3.num_layers,
                        help="plan of the first N layers (default: all)")
    parser.add_argument("--out", type=pathlib.Path, default=native.DEFAULT_DIR)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel C++ compiles")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tps = tuple(int(t) for t in args.tp.split(","))
    report = build(tps, args.layers, args.out, args.jobs)
    print(f"{report['path']}: {report['calls']} kernel calls for TP {args.tp}, "
          f"{args.layers} layers, {report['mib']:.1f} MiB; trace {report['trace_s']:.0f} s, "
          f"export {report['export_s']:.0f} s, handlers+link {report['link_s']:.0f} s, "
          f"total {report['total_s']:.0f} s")


if __name__ == "__main__":
    main()
