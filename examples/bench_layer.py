"""Benchmark: the post-attention tail of one layer (o_proj + all-reduce + AttnRes), kernels
against the XLA reference (dot + psum + reference AttnRes), on a TP mesh of every local GPU.

Per B: the kernel tail (`oproj_attn_res` with a mailbox), the reference tail, and the
reference tail with XLA's one-shot all-reduce kernel (a child process, as in
bench_all_reduce.py). Each timed call runs two layers (parity 0, then 1) with their own
o_proj weights, and the input sets together overflow the L2; the AttnRes is a delta layer over
K = 8 saved blocks. The floor is the o_proj weight's bytes over the measured copy bandwidth.
Writes bench_layer.json and .md to --out.

    python examples/bench_layer.py --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import jax_kimik3 as k3  # noqa: E402
import report  # noqa: E402
from bench_all_reduce import XLA_ONE_SHOT  # noqa: E402
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs  # noqa: E402
from timing import copy_bandwidth, time_per_call  # noqa: E402

CFG = k3.KIMI_K3
H, K_TOTAL, NB = CFG.hidden_size, CFG.o_proj_in_features, CFG.num_attn_res_blocks
NUM_BLOCKS = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,2,8,16,64")
    parser.add_argument("--sets", type=int, default=4, help="input sets (two layers each)")
    parser.add_argument("--reference-only", action="store_true",
                        help="time the reference alone and print JSON (the child process)")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def tail_times(args):
    """{B: {"kernel"|"reference": µs per layer}} on a mesh of every local GPU."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("tp",))
    split = NamedSharding(mesh, P(None, "tp"))
    rng = np.random.default_rng(0)
    mailbox = None if args.reference_only else k3.Mailbox.for_devices(devices)
    times = {}
    for b in map(int, args.batches.split(",")):
        inp = jax.device_put(attn_res_inputs(rng, b, NB), NamedSharding(mesh, P()))
        sets = []
        for _ in range(args.sets):
            layers = [oproj_inputs(rng, b) for _ in range(2)]
            sets.append([jax.device_put(a, split) for layer in layers for a in layer])

        def step(carry, layer_inputs, backend):
            def layers(prefix, out, x0, w0, x1, w1):
                for parity, (x, w) in enumerate(((x0, w0), (x1, w1))):
                    out, prefix, _ = k3.oproj_attn_res(
                        x, w, prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                        inp.out_norm_w, axis_name="tp", num_blocks=NUM_BLOCKS, has_delta=True,
                        mailbox=mailbox if backend == "kernel" else None, parity=parity,
                        backend=backend)
                    # Keeps `out` alive: XLA would drop the reference's unused out otherwise.
                    prefix, out = jax.lax.optimization_barrier((prefix, out))
                return prefix, out
            return jax.shard_map(layers, mesh=mesh, in_specs=(P(), P()) + (P(None, "tp"),) * 4,
                                 out_specs=(P(), P()))(*carry, *layer_inputs)

        carry = (inp.prefix, inp.prefix)
        backends = ("reference",) if args.reference_only else ("kernel", "reference")
        times[b] = {backend: time_per_call(lambda c, s, backend=backend: step(c, s, backend),
                                           carry, sets) / 2 for backend in backends}
    if mailbox is not None:
        mailbox.check()
        mailbox.close()
    return times


def xla_one_shot_times(args):
    """The reference tail's times in a child process with XLA's one-shot all-reduce kernel."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {XLA_ONE_SHOT}")
    child = subprocess.run([sys.executable, __file__, "--reference-only", "--batches",
                            args.batches, "--sets", str(args.sets)],
                           env=env, capture_output=True, text=True)
    if child.returncode:
        print(f"XLA one-shot run failed:\n{child.stderr[-2000:]}", file=sys.stderr)
        return {}
    return {int(b): t["reference"] for b, t in json.loads(child.stdout.splitlines()[-1]).items()}


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_layer needs a GPU")
    times = tail_times(args)
    if args.reference_only:
        print(json.dumps(times))
        return
    tp = len(jax.devices())
    one_shot_xla = xla_one_shot_times(args) if tp > 1 else {}
    bandwidth = copy_bandwidth()
    floor = 1e6 * H * (K_TOTAL // tp) * 2 / bandwidth  # this rank's o_proj weight, streamed once
    rows = [dict(tp=tp, batch=b, kernel_us=t["kernel"], reference_us=t["reference"],
                 reference_one_shot_us=one_shot_xla.get(b, float("nan")),
                 speedup=t["reference"] / t["kernel"], floor_us=floor)
            for b, t in times.items()]
    report.write(args.out, "bench_layer", report.meta(copy_bandwidth_tbps=bandwidth / 1e12), rows,
                 f"Post-attention tail per layer, kernels vs XLA reference, TP{tp} mesh", [
                     ("TP", "{tp}"), ("B", "{batch}"), ("kernel tail µs", "{kernel_us:.2f}"),
                     ("reference µs", "{reference_us:.2f}"),
                     ("reference + XLA one-shot µs", "{reference_one_shot_us:.2f}"),
                     ("speedup", "{speedup:.2f}x"), ("o_proj floor µs", "{floor_us:.2f}")])


if __name__ == "__main__":
    main()
