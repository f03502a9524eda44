"""The README's example runs (on CPU: the reference on host devices)."""

import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)  # the example asks for its own host devices
    return env


def _decode_loop(*flags):
    return [sys.executable, str(ROOT / "examples" / "decode_loop.py"), "--layers", "2",
            "--batch", "2", "--steps", "1", *flags]


def _checksum(stdout):
    return float(re.search(r"checksum (\S+)", stdout).group(1))


@pytest.mark.parametrize("ranks", [["--tp", "4"], ["--virtual-tp", "4", "--stats-ahead"],
                                   ["--dp", "2", "--tp", "4"]],
                         ids=["mesh", "virtual", "dp_tp"])
def test_decode_loop_runs(ranks):
    result = subprocess.run(_decode_loop(*ranks), env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"decode step: 2 layers, batch 2, (DP 2 x )?TP 4 (\(virtual\) )?on cpu "
                     r"\(reference\)", result.stdout)
    checksum = _checksum(result.stdout)
    assert checksum == checksum and abs(checksum) < 1e6  # finite and of a sane size


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,pattern", [
    (["--steps", "0"], r"argument --steps: must be >= 1, got 0"),
    (["--tp", "-1"], r"argument --tp: must be >= 1, got -1"),
    (["--virtual-tp", "0"], r"argument --virtual-tp: must be >= 1, got 0"),
    (["--check-every", "-1"], r"argument --check-every: must be >= 0, got -1"),
])
def test_decode_loop_refuses_counts(capsys, flags, pattern):
    with pytest.raises(SystemExit):
        _example("decode_loop").parse_args(flags)
    assert re.search(pattern, capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--tp", "--virtual-tp"])
def test_decode_loop_refuses_a_tp_that_does_not_split_o_proj(flag):
    with pytest.raises(ValueError, match=rf"{flag}=5 must divide o_proj_in_features=12288"):
        _example("decode_loop").main([flag, "5"])


def test_decode_loop_under_jax_distributed():
    """Two processes (jax.distributed, four host devices each) run the ("dp", "tp") = (2, 4)
    step, one TP group each: their rows' checksums add up to the one-process run's."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    mesh = ["--dp", "2", "--tp", "4"]
    procs = [subprocess.Popen(_decode_loop(*mesh, "--coordinator", address, "--processes", "2",
                                           "--process-id", str(i)),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        done = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, done):
        assert p.returncode == 0, err[-2000:]
    for i, (out, _) in enumerate(done):
        assert f"DP 2 x TP 4, process {i} of 2 on cpu (reference)" in out, out
    one = subprocess.run(_decode_loop(*mesh), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    parts = [_checksum(out) for out, _ in done]
    assert all(parts)  # each process has rows of its own
    # Printed to 7 digits; each part's rounding is at most 5e-7 relative.
    assert abs(sum(parts) - _checksum(one.stdout)) <= 1e-6 * sum(abs(p) for p in parts)


@pytest.mark.parametrize("bench", ["bench_attn_res", "bench_all_reduce", "bench_layer",
                                   "bench_rank"])
def test_benchmark_runs_as_a_module_and_says_it_needs_a_gpu(tmp_path, bench):
    """`python -m benchmarks.<bench>` imports (no sys.path edits) and, on CPU, stops with why."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", "--out", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode != 0
    assert f"{bench} needs a GPU" in result.stderr, result.stderr[-2000:]


def test_launch_floor_kernel_lowers_for_cuda():
    """bench_attn_res's launch floor (a row copy of the AttnRes launch shape) compiles for
    sm_90a and lowers to one kernel call (no GPU needed)."""
    pytest.importorskip("cutlass")
    import jax
    import jax.numpy as jnp

    from benchmarks.launch_floor import row_copy

    text = jax.jit(row_copy).trace(jax.ShapeDtypeStruct((8, 7168), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") == 1
