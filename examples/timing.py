"""Device timing for the benchmarks: the latency of one call inside one jit, dispatch cancelled.

A chain of calls runs in one jitted function; each call reads the previous call's result (so
XLA can neither merge nor overlap them: this is latency, as in a decode step) and its own
input set (so no two calls share inputs and the sets together overflow the L2). With T the
median wall time of one whole jitted chain, a call takes (T(n) − T(n/2)) / (n/2): the fixed
cost of dispatch and synchronisation cancels.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_wall(fn, args, repeats):
    for _ in range(3):  # compile, then warm up
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_per_call(step, carry, input_sets, *, repeats=50):
    """Median µs of one `carry = step(carry, inputs)` over `input_sets` (pytrees, even count)."""
    n = len(input_sets)

    def chain(count):
        def run(carry, sets):
            for inputs in sets[:count]:
                carry = step(carry, inputs)
            return carry
        return jax.jit(run)

    half, full = (_median_wall(chain(c), (carry, input_sets), repeats) for c in (n // 2, n))
    return 1e6 * (full - half) / (n // 2)


def copy_bandwidth(size_bytes=512 << 20, count=8):
    """Measured device copy bandwidth in bytes/s: a read and a write of `size_bytes` per call."""
    x = jnp.zeros((size_bytes // 2,), jnp.bfloat16)
    per_call = time_per_call(lambda a, _: jax.lax.optimization_barrier(a + jnp.bfloat16(1)),
                             x, [None] * count, repeats=20)
    return 2 * size_bytes / (per_call * 1e-6)
