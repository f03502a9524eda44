"""Device timing for the benchmarks: per-call time inside one jit, launch overhead cancelled.

A chain of n calls over rotated input sets runs in one jitted function; the time of a call is
(T(2n) − T(n)) / n with T the median wall time of the whole jitted chain, so the fixed cost of
dispatching the jit and synchronising drops out.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_wall(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_per_call(op, input_sets, *, chain=32, repeats=30):
    """Median µs of one `op(inputs)` call, `input_sets` rotated (a list of pytrees)."""
    def chained(n):
        def run(sets):
            return [op(sets[i % len(sets)]) for i in range(n)]
        return jax.jit(run)

    short, long = (_median_wall(chained(n), (input_sets,), repeats) for n in (chain, 2 * chain))
    return 1e6 * (long - short) / chain


def copy_bandwidth(size_bytes=1 << 30):
    """Measured device copy bandwidth (bytes/s): read + write of a `size_bytes` bf16 array."""
    x = jnp.ones((size_bytes // 2,), jnp.bfloat16)
    per_call = time_per_call(lambda a: a + jnp.bfloat16(1), [x], chain=4, repeats=10)
    return 2 * size_bytes / (per_call * 1e-6)
