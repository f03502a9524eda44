"""Device timing for the benchmarks: the GPU time of one call inside one jit, from a profile.

A chain of calls runs in one jitted function; each call reads the previous call's result (so
XLA can neither merge nor overlap them: this is latency, as in a decode step) and its own
input set (no two calls share inputs, and the sets together overflow the L2). The chain runs
`repeats` times under the JAX profiler; a call's time is the median over the runs of the
module's span on the GPU (first kernel start to last kernel end, launch gaps inside the
module included, host dispatch excluded) divided by the chain's length. Beside it, each
kernel's own GPU time per call (the sum of its durations in a run over the chain's length, median
over the runs): a kernel's share of the read bandwidth is held against that.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

XLA_ONE_SHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
PAUSE_S = 0.002  # the host waits this long between runs of the chain ...
GAP_US = 1000.0  # ... so an idle GPU gap this long separates two runs


def _gpu_kernel_events(trace_dir):
    """(start µs, end µs, name) of every event on a GPU stream line of the perfetto trace."""
    path = next(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in e["args"]["name"]}
    lines = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M"
             and e.get("name") == "thread_name" and e["pid"] in gpu_pids}
    streams = {key for key, name in lines.items() if "stream" in name.lower()}
    if not streams:
        raise RuntimeError(f"no GPU stream lines in the profile; lines: {sorted(lines.values())}")
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams)


def _runs(events):
    """Group kernel events into runs of the chain, split at idle gaps longer than GAP_US:
    [[(start µs, end µs, name) of each kernel of the run]]."""
    runs = []
    for event in events:
        if not runs or event[0] - max(e for _, e, _ in runs[-1]) > GAP_US:
            runs.append([])
        runs[-1].append(event)
    return runs


def _timeline(runs, calls):
    """{kernel name: (median start, median end) µs from its call's first kernel start}, for
    the kernels that run once per call: the c-th launch of each belongs to call c."""
    per_call = [name for name in {n for _, _, n in runs[0]}
                if all(sum(n == name for _, _, n in run) == calls for run in runs)]
    if not per_call:  # e.g. a kernel that runs twice per call, and nothing else
        return {}
    offsets = {name: [] for name in per_call}
    for run in runs:
        launches = {name: [(s, e) for s, e, n in run if n == name] for name in per_call}
        for c in range(calls):
            first = min(launches[name][c][0] for name in per_call)
            for name in per_call:
                s, e = launches[name][c]
                offsets[name].append((s - first, e - first))
    medians = {name: tuple(float(v) for v in np.median(np.array(o), axis=0))
               for name, o in offsets.items()}
    return dict(sorted(medians.items(), key=lambda item: item[1]))


class ChainProfile(NamedTuple):
    """One call of a chain: its share of the module's GPU span, each kernel's own GPU µs, and
    when each kernel that runs once per call starts and ends within its call."""

    span_us: float
    kernel_us: dict[str, float]
    timeline_us: dict[str, tuple[float, float]]


def profile_per_call(step, carry, input_sets, *, repeats=20) -> ChainProfile:
    """Median GPU µs of one `carry = step(carry, inputs)` over `input_sets` (a list of pytrees),
    and of each kernel it runs."""
    @jax.jit
    def chain(carry, sets):
        for inputs in sets:
            carry = step(carry, inputs)
        return carry

    for _ in range(3):  # compile, then warm up
        jax.block_until_ready(chain(carry, input_sets))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(chain(carry, input_sets))
                time.sleep(PAUSE_S)
        runs = _runs(_gpu_kernel_events(trace_dir))
    if len(runs) != repeats:
        raise RuntimeError(f"found {len(runs)} runs of the chain in the profile, expected {repeats}")
    calls = len(input_sets)
    names = sorted({name for run in runs for _, _, name in run})
    spans = [max(e for _, e, _ in run) - min(s for s, _, _ in run) for run in runs]
    return ChainProfile(
        span_us=float(np.median(spans)) / calls,
        kernel_us={name: float(np.median([sum(e - s for s, e, n in run if n == name)
                                          for run in runs])) / calls for name in names},
        timeline_us=_timeline(runs, calls))


def time_per_call(step, carry, input_sets, *, repeats=20):
    """Median GPU µs of one `carry = step(carry, inputs)` over `input_sets` (a list of pytrees)."""
    return profile_per_call(step, carry, input_sets, repeats=repeats).span_us


def read_bandwidth(size_bytes=1 << 30, count=4):
    """Measured device read bandwidth in bytes/s, the floor of a read-bound kernel (the o_proj
    weight stream): each call reduces its own `size_bytes` of bf16 (`count` arrays, together
    past the L2 when small) scaled by the previous call's result, so XLA can neither hoist the
    reduction out of the chain nor merge two of them. At 1 GiB the launch and ramp of a call
    vanish; at a weight's size they are what any kernel reading those bytes pays too."""
    arrays = [jnp.full((size_bytes // 2,), 1e-3 * (i + 1), jnp.bfloat16) for i in range(count)]

    def step(c, data):
        return jnp.tanh(jnp.sum(data * c.astype(jnp.bfloat16), dtype=jnp.float32))

    per_call = time_per_call(step, jnp.float32(1.0), arrays, repeats=5)
    return size_bytes / (per_call * 1e-6)


def with_xla_one_shot(module, argv, column):
    """{B: µs} of `column` from a child run of `python -m module` (which prints {B: {column:
    µs}} as its last line) in a process started with XLA's one-shot all-reduce kernel (XLA
    reads flags at start-up); {} if the child fails."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {XLA_ONE_SHOT}")
    child = subprocess.run([sys.executable, "-m", module, *argv], env=env, capture_output=True,
                           text=True)
    if child.returncode:
        print(f"XLA one-shot run failed:\n{child.stderr[-2000:]}", file=sys.stderr)
        return {}
    return {int(b): t[column] for b, t in json.loads(child.stdout.splitlines()[-1]).items()}


def cublas_per_call(batch, k, n, count, *, repeats=50):
    """Median GPU µs of torch's bf16 x [B, K] @ w.T ([N, K]; cuBLAS) over `count` weights
    (past the L2), captured in one CUDA graph and timed with CUDA events; None where torch
    (with CUDA) is not installed. The best library GEMV, beside XLA's dot."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(count)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights:  # warm up: cuBLAS picks its kernels and workspace here
            torch.matmul(x, w.t())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for w in weights:
                torch.matmul(x, w.t())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / count)
    return float(np.median(times))
