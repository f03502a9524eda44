"""Benchmark: the AttnRes kernel against the jitted pure-JAX reference (post-attention, delta).

For each form (`blocks`: mix the K saved blocks; `statistics`: their precomputed statistics,
as the pre-attention and final call sites can), batch B and saved-block count K: median µs per
call inside one jit (inputs rotated),
the AttnRes kernel's own GPU time within it, the launch floor (per call, a kernel of the same
launch shape that only copies the prefix: benchmarks/launch_floor.py), achieved GB/s, the
floor (bytes moved over the measured read bandwidth), the speedup over the reference and the
kernel's time over (floor + 2 µs). Writes bench_attn_res.json and .md to --out.

    python -m benchmarks.bench_attn_res --out /tmp/bench
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import jax
import numpy as np

import jax_kimik3 as k3
from benchmarks import report
from benchmarks.launch_floor import row_copy
from benchmarks.timing import profile_per_call, read_bandwidth, time_per_call
from jax_kimik3.inputs import attn_res_inputs

H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,8,16,32,64")
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--forms", default="blocks,statistics",
                        help="mix the K saved blocks, or their precomputed statistics")
    parser.add_argument("--sets", type=int, default=64, help="input sets, one per call (past the L2)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_attn_res needs a GPU")
    bandwidth = read_bandwidth()
    rng = np.random.default_rng(0)
    rows = []
    for b in map(int, args.batches.split(",")):
        sets = [jax.device_put(attn_res_inputs(rng, b, NB)) for _ in range(args.sets)]
        launch_us = time_per_call(lambda prefix, i: row_copy(prefix), sets[0].prefix, sets)
        for form, k in itertools.product(args.forms.split(","), map(int, args.ks.split(","))):
            precomputed = form == "statistics"
            inputs = [(i, k3.attn_res_statistics(i.blocks, i.res_norm_w, i.res_proj_w,
                                                 num_blocks=k) if precomputed else None)
                      for i in sets]

            def step(prefix, inputs, backend):  # the output is the next call's prefix
                i, stats = inputs
                return k3.attn_res(prefix, i.blocks, i.res_norm_w, i.res_proj_w, i.out_norm_w,
                                   num_blocks=k, delta=i.delta, stats=stats, backend=backend)[0]
            profile = profile_per_call(functools.partial(step, backend="kernel"),
                                       sets[0].prefix, inputs)
            kernel = profile.span_us
            own = [us for name, us in profile.kernel_us.items() if "AttnRes" in name]
            if len(own) != 1:
                raise RuntimeError(f"expected one AttnRes kernel, found {sorted(profile.kernel_us)}")
            ref = time_per_call(functools.partial(step, backend="reference"), sets[0].prefix,
                                inputs)
            # Read the K blocks (or the fp32 mixture), prefix, delta; write out, new prefix.
            moved = ((2 if precomputed else k) + 4) * b * H * 2
            floor = 1e6 * moved / bandwidth
            rows.append(dict(form=form, batch=b, k=k, kernel_us=kernel, kernel_own_us=own[0],
                             launch_floor_us=launch_us, reference_us=ref,
                             speedup=ref / kernel, kernel_gbps=moved / kernel / 1e3,
                             floor_us=floor, vs_floor_plus_2us=kernel / (floor + 2.0)))
    info = report.meta(read_bandwidth_tbps=bandwidth / 1e12)
    report.write(args.out, "bench_attn_res", info, rows,
                 f"AttnRes kernel vs jitted reference (read {bandwidth / 1e12:.2f} TB/s)", [
                     ("form", "{form}"), ("B", "{batch}"), ("K", "{k}"),
                     ("kernel µs", "{kernel_us:.2f}"),
                     ("its kernel's own µs", "{kernel_own_us:.2f}"),
                     ("launch floor µs", "{launch_floor_us:.2f}"),
                     ("reference µs", "{reference_us:.2f}"), ("speedup", "{speedup:.2f}x"),
                     ("kernel GB/s", "{kernel_gbps:.0f}"), ("floor µs", "{floor_us:.2f}"),
                     ("kernel/(floor+2µs)", "{vs_floor_plus_2us:.2f}")])

if __name__ == "__main__":
    main()
