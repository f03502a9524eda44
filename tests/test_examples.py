"""The README's example runs (on CPU: the reference on host devices)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

@pytest.mark.parametrize("ranks", [["--tp", "4"], ["--virtual-tp", "4", "--stats-ahead"]],
                         ids=["mesh", "virtual"])
def test_decode_loop_runs(ranks):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)  # the example asks for its own host devices
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "decode_loop.py"), "--layers", "2", "--batch",
         "2", *ranks, "--steps", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"decode step: 2 layers, batch 2, TP 4 (\(virtual\) )?on cpu \(reference\)",
                     result.stdout)
    checksum = float(re.search(r"checksum (\S+)", result.stdout).group(1))
    assert checksum == checksum and abs(checksum) < 1e6  # finite and of a sane size


@pytest.mark.parametrize("bench", ["bench_attn_res", "bench_all_reduce", "bench_layer",
                                   "bench_rank"])
def test_benchmark_runs_as_a_module_and_says_it_needs_a_gpu(tmp_path, bench):
    """`python -m benchmarks.<bench>` imports (no sys.path edits) and, on CPU, stops with why."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", "--out", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode != 0
    assert f"{bench} needs a GPU" in result.stderr, result.stderr[-2000:]
