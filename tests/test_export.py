"""CPU: a kernel decode step exported for CUDA (jax.export) carries its kernels, and a process
without the CuTe DSL deserializes it and registers the kernels' FFI handlers."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import jax_kimik3 as k3

pytest.importorskip("cutlass")
from jax_kimik3 import export  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def runtime_library():
    from cutlass.jax.ffi import find_cute_dsl_runtime_library
    return find_cute_dsl_runtime_library()


def test_exported_decode_step_runs_without_the_dsl(tmp_path):
    """decode_loop.py --export on this CPU host, then a fresh process with `import cutlass`
    failing: the artifact deserializes for 2 CUDA devices, takes the peer table as its last
    operand, and holds every kernel (host object + cubin) in its custom calls."""
    path = tmp_path / "step.bin"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)  # the example asks for its own host devices
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "decode_loop.py"), "--layers",
                           "2", "--batch", "4", "--tp", "2", "--export", str(path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "kernel custom calls" in made.stdout
    check = textwrap.dedent(f"""
        import json, sys
        class NoDSL:
            def find_spec(self, name, *args):
                if name.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl"):
                    raise ImportError(f"{{name}} is absent on this host")
        sys.meta_path.insert(0, NoDSL())
        from jax_kimik3 import export
        exported = export.load(open({str(path)!r}, "rb").read(), library={runtime_library()!r})
        text = exported.mlir_module()
        print(json.dumps(dict(platforms=exported.platforms, devices=exported.nr_devices,
                              table=str(exported.in_avals[-1]),
                              calls=text.count("custom_call @" + export.FFI_TARGET),
                              objects=text.count("\\\\7FELF"),
                              dsl="cutlass" in sys.modules)))
    """)
    loaded = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    got = json.loads(loaded.stdout.splitlines()[-1])
    assert got["platforms"] == ["cuda"] and got["devices"] == 2 and not got["dsl"]
    assert got["table"] == "uint32[2,3,2]"  # a [3, 2] block per device: MeshMailbox.table
    # Each kernel's custom call holds its host object and, inside that, its cubin: two ELFs.
    # At least: each layer's pre-attention AttnRes and its tail (at B = 4, TP 2: one
    # call), and the final AttnRes.
    assert got["calls"] >= 4 and got["objects"] == 2 * got["calls"]


def test_register_runtime_without_a_library_needs_the_dsl(monkeypatch):
    """With the DSL installed and no library given, the DSL registers its own handlers."""
    monkeypatch.delenv(export.RUNTIME_ENV, raising=False)
    export.register_runtime.cache_clear()
    assert export.register_runtime() == "the CuTe DSL"


def test_spec_without_a_peer_table_is_a_value_error():
    spec = k3.MailboxSpec(k3.MailboxLayout(2))
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("tp",))
    P = jax.sharding.PartitionSpec

    def lower(**kwargs):
        f = jax.shard_map(lambda x: k3.all_reduce(x, spec, axis_name="tp", **kwargs),
                          mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
        return jax.jit(f).trace(jax.ShapeDtypeStruct((8, 7168), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",))

    with pytest.raises(ValueError, match=r"has no memory: pass its peer_table= \(uint32 \[3, 2\]"):
        lower()
    with pytest.raises(ValueError, match=r"peer_table has shape=\(2, 2\) dtype=uint32; "
                                         r"expected shape=\(3, 2\)"):
        lower(peer_table=jnp.zeros((2, 2), jnp.uint32))
    assert export.FFI_TARGET in lower(peer_table=jnp.zeros((3, 2), jnp.uint32)).as_text()
