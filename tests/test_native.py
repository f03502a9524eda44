"""CPU: the kernel library (ffi/, jax_kimik3.native_build) builds for a TP subset, every
handler registers, and a decode step lowered with JAX_KIMIK3_KERNELS=aot calls the library's
handlers alone, in a process where the CuTe DSL cannot be imported."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cutlass")
from jax_kimik3 import backend, native, native_build  # noqa: E402
from jax_kimik3.config import KIMI_K3  # noqa: E402
from jax_kimik3.kernels import attn_res_ops  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TPS, LAYERS = (2,), 2  # what the test library holds: a decode step at TP 2 over 2 layers
H, NB = KIMI_K3.hidden_size, KIMI_K3.num_attn_res_blocks
# Shared libraries a host without the CUDA toolkit or the DSL has (the driver is dlopened).
SYSTEM_LIBRARIES = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6",
                    "ld-linux-x86-64.so.2", "libdl.so.2", "libpthread.so.0", "librt.so.1"}
NO_DSL = """
import sys
class NoDSL:
    def find_spec(self, name, *args):
        if name.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl"):
            raise ImportError(f"{name} is absent on this host")
sys.meta_path.insert(0, NoDSL())
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The build as a user runs it, for TP 2 and 2 layers: (library path, its report line).
    Skipped where the build's tools are missing (README, "Test"; CI has them)."""
    missing = [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"building the kernel library needs {missing} (and the CUDA toolkit)")
    out = tmp_path_factory.mktemp("ffi")
    done = subprocess.run([sys.executable, "-m", "jax_kimik3.native_build", "--tp",
                           ",".join(map(str, TPS)), "--layers", str(LAYERS), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    return out / native.LIBRARY_NAME, done.stdout.splitlines()[-1]


def run_without_dsl(script, library, mode="aot", devices=2):
    """`script` in a fresh process where `import cutlass` fails; its last line, as JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_KIMIK3_KERNELS=mode,
               JAX_KIMIK3_LIBRARY=str(library),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", NO_DSL + textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_library_holds_every_catalog_call(built):
    """The manifest lists exactly the catalog's calls; the library needs no CUDA runtime and
    no DSL library at load, and exports only handlers and the manifest."""
    path, report = built
    library = native.load_library(path)
    want = native_build.record_calls(TPS, LAYERS)
    assert set(library.calls) == set(want)
    assert f": {len(want)} kernel calls for TP 2, {LAYERS} layers" in report
    assert library.arch == "sm_90a" and not library.stale
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                            subprocess.run(["readelf", "-d", str(path)], capture_output=True,
                                           text=True, check=True).stdout))
    assert needed and needed <= SYSTEM_LIBRARIES, needed - SYSTEM_LIBRARIES
    exported = set(subprocess.run(["nm", "-D", "--defined-only", "--format=just-symbols",
                                   str(path)], capture_output=True, text=True,
                                  check=True).stdout.split())
    handlers = {f"{name}_{stage}" for name in want for stage in native.STAGES}
    assert exported == handlers | {native.MANIFEST_SYMBOL}


def test_every_handler_registers_without_the_dsl(built):
    """Each call's instantiate and execute handlers go to XLA for CUDA, as typed FFI."""
    path, _ = built
    got = run_without_dsl("""
        import json
        from jaxlib import xla_client
        from jax_kimik3 import native
        names = native.library().register()
        pending = {n: (api, traits) for n, fn, api, traits in xla_client._custom_callback["CUDA"]
                   if isinstance(fn, dict) and sorted(fn) == ["execute", "instantiate"]}
        print(json.dumps(dict(names=names, pending={n: pending.get(n) for n in names},
                              dsl="cutlass" in sys.modules)))
    """, path)
    assert len(got["names"]) == len(native.load_library(path).calls) and not got["dsl"]
    assert all(v == [1, 1] for v in got["pending"].values()), got["pending"]


@pytest.mark.parametrize("stats_ahead", [False, True], ids=["blocks", "stats_ahead"])
def test_aot_decode_step_lowers_to_the_library(built, stats_ahead):
    """The canonical decode step at TP 2, lowered for CUDA with JAX_KIMIK3_KERNELS=aot: only the
    library's targets, in the tail variant tuning.py picks: at B = 4, 20 and 56 the split tail
    call (the producer kernel inside it, at 1, 3 and 7 B tiles), so no o_proj dot."""
    path, _ = built
    got = run_without_dsl(f"""
        import json, re, sys
        import jax, jax.numpy as jnp
        import jax_kimik3.decode as dl
        import jax_kimik3 as k3
        mesh = jax.sharding.Mesh(jax.devices()[:2], ("tp",))
        params = jax.eval_shape(lambda: dl.init_params(jax.random.key(0), mesh, {LAYERS}))
        step = dl.make_step(mesh, params, {LAYERS}, "kernel", k3.MailboxSpec(k3.MailboxLayout(2)),
                            stats_ahead={stats_ahead})
        s = jax.ShapeDtypeStruct
        targets, dots = {{}}, {{}}
        for b in (4, 20, 56):
            text = step.trace(params, s((b, {H}), jnp.bfloat16), s((b, {NB}, {H}), jnp.bfloat16),
                              s((2, 3, 2), jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
            targets[b] = re.findall(r"custom_call @(\\w+)", text)
            dots[b] = text.count("dot_general")
        print(json.dumps(dict(targets=targets, dots=dots, dsl="cutlass" in sys.modules)))
    """, path)
    names = set(native.load_library(path).calls)
    families = {b: {t.split("_")[1] for t in targets} for b, targets in got["targets"].items()}
    for targets in got["targets"].values():
        assert targets and set(targets) <= names, targets
    assert all(f == {"attn", "tail"} for f in families.values()), families
    # The stand-ins for attention and the MLP are the dots, the same in every step.
    assert got["dots"]["56"] == got["dots"]["20"] == got["dots"]["4"] > 0
    assert not got["dsl"]


def call_outside_the_catalog():
    """attn_res at eps = 1e-6: no decode step makes this call."""
    s = jax.ShapeDtypeStruct
    return jax.jit(lambda p, b, w: attn_res_ops.attn_res(
        p, b, w, w, w, num_blocks=2, delta=p, write_idx=-1, eps=1e-6, out_eps=1e-6,
        stats=None)).trace(s((4, H), jnp.bfloat16), s((4, NB, H), jnp.bfloat16),
                           s((H,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()


def test_aot_refuses_a_call_the_library_lacks(built, monkeypatch):
    monkeypatch.setenv(native.LIBRARY_ENV, str(built[0]))
    monkeypatch.setenv(backend.KERNELS_ENV, "aot")
    with pytest.raises(RuntimeError, match=r"=aot: kernel k3_attn_res_\w+ \(attn_res\(AttnRes"
                                           r"Variant\(num_blocks=2.*eps=1e-06.*does not hold it"):
        call_outside_the_catalog()


def test_auto_compiles_what_the_library_lacks(built, monkeypatch):
    monkeypatch.setenv(native.LIBRARY_ENV, str(built[0]))
    monkeypatch.setenv(backend.KERNELS_ENV, "auto")
    assert "CuteDSLRT_NvJaxCutlassCall" in call_outside_the_catalog()


def test_auto_without_the_dsl_names_what_the_library_lacks(built, monkeypatch):
    """auto mode on a host without the DSL: a call the library lacks is a RuntimeError that
    names it, not an ImportError from inside the JIT path."""
    monkeypatch.setenv(native.LIBRARY_ENV, str(built[0]))
    monkeypatch.setenv(backend.KERNELS_ENV, "auto")
    monkeypatch.setattr(backend, "dsl_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"=auto: kernel k3_attn_res_\w+ .*does not hold it "
                                           r"and the CuTe DSL \(to compile it\) is not installed"):
        call_outside_the_catalog()


def test_a_stale_library_is_refused(built, monkeypatch):
    """Kernel sources changed since the build: aot refuses the library, auto compiles."""
    monkeypatch.setenv(native.LIBRARY_ENV, str(built[0]))
    monkeypatch.setattr(native, "source_digest", lambda: "edited")
    monkeypatch.setenv(backend.KERNELS_ENV, "aot")
    with pytest.raises(RuntimeError, match="built from other kernel sources than this package"):
        call_outside_the_catalog()
    monkeypatch.setenv(backend.KERNELS_ENV, "auto")
    with pytest.warns(UserWarning, match="compiling the kernels instead"):
        assert "CuteDSLRT_NvJaxCutlassCall" in call_outside_the_catalog()


def test_a_build_without_the_sources_is_refused_before_tracing(tmp_path, monkeypatch):
    """An install without ffi/ (not an editable one) names what is missing at once, instead
    of tracing the catalog and failing in CMake."""
    monkeypatch.setattr(native_build, "SOURCE_DIR", tmp_path / "ffi")
    monkeypatch.setattr(native_build, "record_calls", lambda *a: pytest.fail("traced"))
    with pytest.raises(FileNotFoundError, match="CMakeLists.txt.*source checkout"):
        native_build.build((2,), 1, tmp_path / "out", jobs=1)


def test_aot_without_a_library_and_bad_modes_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(native.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="missing.so does not exist"):
        native.library()
    monkeypatch.setenv(native.LIBRARY_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=rf"JAX_KIMIK3_LIBRARY={tmp_path} is not the kernel "
                                           r"library \(python -m jax_kimik3.native_build"):
        native.library()
    monkeypatch.setenv(backend.KERNELS_ENV, "ahead")
    with pytest.raises(ValueError, match=r"JAX_KIMIK3_KERNELS='ahead' must be one of"):
        backend.kernel_mode()


HARNESS = """
#include <cstdio>
#include "k3_handler.h"
#include "{name}.h"
static int success() {{ return 0; }}
extern "C" {{
cudaError_t cudaGetDriverEntryPointByVersion(const char*, void** f, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {{
  *f = reinterpret_cast<void*>(success);
  if (status) *status = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}}
cudaError_t cudaGetDevice(int* d) {{ *d = 0; return cudaSuccess; }}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {{ *v = 1 << 20; return cudaSuccess; }}
cudaError_t cudaLibraryGetKernel(cudaKernel_t* k, cudaLibrary_t, const char*) {{
  *k = reinterpret_cast<cudaKernel_t>(1); return cudaSuccess; }}
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* c, const void*, void** args) {{
  std::printf("grid %u %u %u\\n", c->gridDim.x, c->gridDim.y, c->gridDim.z);
  for (int i = 0; i < {buffers}; ++i) std::printf("%p\\n", *static_cast<void**>(args[i]));
  return cudaSuccess;
}}
}}
int main() {{
  int64_t blocks[3] = {{{batch}, {nb}, {h}}}, weight[1] = {{{h}}}, mixture[2] = {{{batch}, {h}}},
          scal[2] = {{{batch}, 2}};
  k3::Descriptor d[5] = {{{{(void*)0x1000, blocks}}, {{(void*)0x2000, weight}},
                         {{(void*)0x3000, weight}}, {{(void*)0x4000, mixture}},
                         {{(void*)0x5000, scal}}}};
  {name}_Kernel_Module_t module{{}};
  return cute_dsl_{name}_wrapper(&module, nullptr, &d[0], &d[1], &d[2], &d[3], &d[4]);
}}
"""


def test_exported_kernel_reads_buffers_as_the_handler_passes_them(tmp_path):
    """k3_handler.h hands each buffer to an exported kernel as {data, dims}: run the statistics
    call's host code on this CPU against a fake CUDA runtime; the launch gets the pointers in
    order and its grid from the batch in dims (B = 5, not a compile-time constant)."""
    call, fn, spec = next(v for v in native_build.record_calls(TPS, LAYERS).values()
                          if v[0].variant.family == "statistics")
    native_build.export_object(call.name, fn, spec, tmp_path)
    lib = native_build.dsl_lib_dir() / "libcuda_dialect_runtime_static.a"
    runtime = subprocess.run(["nm", "-u", str(lib)], capture_output=True, text=True,
                             check=True).stdout.split()
    faked = {"cudaGetDevice", "cudaDeviceGetAttribute", "cudaLibraryGetKernel",
             "cudaLaunchKernelExC", "cudaGetDriverEntryPointByVersion"}
    stubs = sorted({s for s in runtime if s.startswith("cuda") and s.isidentifier()} - faked)
    (tmp_path / "stubs.c").write_text("".join(f"int {s}(void) {{ return 0; }}\n" for s in stubs))
    (tmp_path / "harness.cc").write_text(HARNESS.format(name=call.name, buffers=5, batch=5, nb=NB,
                                                        h=H))
    subprocess.run(["g++", "-std=c++17", f"-I{native_build.SOURCE_DIR}", f"-I{tmp_path}",
                    f"-I{jax.ffi.include_dir()}", "-I/usr/local/cuda/include", "-x", "c++",
                    str(tmp_path / "harness.cc"), "-x", "c", str(tmp_path / "stubs.c"), "-x",
                    "none", str(tmp_path / f"{call.name}.o"), str(lib), "-o",
                    str(tmp_path / "harness")], check=True, capture_output=True)
    ran = subprocess.run([str(tmp_path / "harness")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["grid", "7", "5", "1"] + [hex(a) for a in range(0x1000, 0x6000,
                                                                                  0x1000)]


def test_digest_follows_code_not_docstrings_or_comments():
    """A docstring, comment or layout edit leaves a kernel source's code (what the digest
    hashes) as it was; a change of code does not."""
    source = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert native._code(source) == native._code('def f(x):\n    """Other."""\n\n'
                                                 '    return (x +\n            1)\n')
    assert native._code(source) == native._code("def f(x):\n    return x + 1\n")
    assert native._code(source) != native._code("def f(x):\n    return x + 2\n")


def test_digest_covers_the_kernels_and_what_they_import():
    """The digest's sources: every module that makes a kernel object and what it imports in
    turn (the primitives, the mailbox layout, the config), not the catalog, the API or the
    allocator (kernels import the layout, not jax_kimik3.mailbox)."""
    names = {p.relative_to(native.PACKAGE).as_posix() for p in native.kernel_sources()}
    assert {"kernels/attn_res.py", "kernels/lamport.py", "kernels/producer.py",
            "kernels/fused.py", "kernels/tail.py", "kernels/primitives.py",
            "kernels/geometry.py", "layout.py", "config.py"} <= names
    assert not names & {"kernels/catalog.py", "kernels/launch.py", "kernels/attn_res_ops.py",
                        "kernels/producer_ops.py", "api.py", "layer.py", "decode.py",
                        "reference.py", "native.py", "backend.py", "mailbox.py"}


def _other_pythons():
    """CPython interpreters of other versions the package supports (3.11 on) on this host
    (pyenv's, or on PATH)."""
    found = {}
    candidates = [f"python3.{minor}" for minor in range(11, 16)]
    roots = sorted(pathlib.Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
                   .glob("versions/3.*/bin/python3"))
    for path in [*(shutil.which(c) for c in candidates), *map(str, roots)]:
        if not path:
            continue
        version = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"],
                                 capture_output=True, text=True).stdout.split()
        version = tuple(map(int, version)) if len(version) == 2 else None
        if (version and version >= (3, 11) and version != sys.version_info[:2]
                and version not in found):
            found[version] = path
    return found


def test_source_digest_does_not_depend_on_the_python_version():
    """The library's source digest is the same under every Python that parses the package:
    a library built under 3.11 was stale under the GPU host's 3.12 (3.12 adds type_params=[]
    to every def). Where no other CPython is installed, its mechanism is checked: no None or
    empty field reaches the text."""
    text = native._code(native.kernel_sources()[0].read_text())
    assert "=None" not in text and "=[]" not in text and "type_params" not in text
    program = textwrap.dedent(f"""
        import ast, hashlib, pathlib
        ns = {{"ast": ast}}
        for node in ast.parse(pathlib.Path({str(native.__file__)!r}).read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in ("_code", "_dump"):
                exec(compile(ast.Module([node], []), "native", "exec"), ns)
        paths = {[str(p) for p in native.kernel_sources()]!r}
        print(hashlib.sha256("".join(ns["_code"](pathlib.Path(p).read_text())
                                     for p in paths).encode()).hexdigest())
    """)
    here = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True).stdout
    for version, python in _other_pythons().items():
        there = subprocess.run([python, "-c", program], capture_output=True, text=True)
        assert there.returncode == 0, there.stderr[-2000:]
        assert there.stdout == here, f"Python {version} reads another digest"
