"""CPU: the library's catalog (jax_kimik3/kernels/catalog.py) holds every kernel call that
decode steps make, at every TP, across the batches where the tail's tables change variant,
with and without statistics ahead (traced only: nothing compiles)."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

from jax_kimik3 import backend
from jax_kimik3.kernels import catalog, launch

pytest.importorskip("cutlass")
ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = 13  # through the first block write after the embedding (layer 12)
BATCHES = (1, 4, 5, 16, 17, 63, 64)  # the edges of tuning.py's tables
STEP_CALLS = """
import json, sys
sys.argv = ["decode_loop", "--tp", "{tp}"]
import decode_loop as dl
import jax, jax.numpy as jnp
import jax_kimik3 as k3
from jax_kimik3 import backend
from jax_kimik3.kernels import launch
mesh = jax.sharding.Mesh(jax.devices(), ("tp",))
params = jax.eval_shape(lambda: dl.init_params(jax.random.key(0), mesh, {layers}))
s = jax.ShapeDtypeStruct
made = set()
with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: made.add(c.name)):
    for stats_ahead in (False, True):
        step = dl.make_step(mesh, params, {layers}, "kernel",
                            k3.MailboxSpec(k3.MailboxLayout({tp})), stats_ahead=stats_ahead)
        for b in {batches}:
            step.trace(params, s((b, 7168), jnp.bfloat16), s((b, 8, 7168), jnp.bfloat16),
                       s(({tp} + 1, 2), jnp.uint32))
print(json.dumps(sorted(made)))
"""


@pytest.fixture(scope="module")
def catalog_names():
    seen = set()
    with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: seen.add(c.name)):
        for _, function, args in catalog.decode_calls(num_layers=LAYERS):
            jax.make_jaxpr(function)(*args)
    return seen


@pytest.mark.parametrize("tp", catalog.TP_VALUES)
def test_decode_steps_call_only_catalog_kernels(catalog_names, tp):
    """decode_loop's step on a TP mesh of host devices, traced at each batch."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={tp}")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STEP_CALLS.format(tp=tp, layers=LAYERS,
                                                                 batches=BATCHES))],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    made = set(json.loads(done.stdout.splitlines()[-1]))
    assert made and made <= catalog_names, sorted(made - catalog_names)
