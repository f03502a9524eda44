"""Benchmark: the Lamport mailbox all-reduce against XLA's.

--mode mesh (several GPUs): a TP mesh of every local GPU, one JAX device each, under shard_map.
  Per B: one-shot and two-shot mailbox all-reduce; `psum` (NCCL; fp32 sum of the bf16 rows, as
  the reference does); and the same psum with XLA's own one-shot kernel
  (--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true, in a child process: XLA reads
  flags at start-up). Each call's input is the last call's result (latency, as in decode).
--mode virtual (one GPU): every rank's producer, [owner,] consumer on one device, against XLA
  summing [TP, B, H] there. This measures the protocol's cost, not NVLink.
Writes bench_all_reduce_<mode>.json and .md to --out.

    python -m benchmarks.bench_all_reduce --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from benchmarks import report
from benchmarks.timing import time_per_call, with_xla_one_shot
from jax_kimik3 import reference

H = k3.KIMI_K3.hidden_size


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("mesh", "virtual"), default=None,
                        help="default: mesh on several GPUs, virtual on one")
    parser.add_argument("--tps", default="2,4,8,16", help="virtual mode: TP sizes")
    parser.add_argument("--batches", default="1,8,16,64")
    parser.add_argument("--sets", type=int, default=16, help="calls per timed chain")
    parser.add_argument("--psum-only", action="store_true",
                        help="mesh mode: time psum alone and print JSON (the child process)")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def mesh_times(args):
    """{B: {column: µs}} on a mesh of every local GPU; each timed call runs two all-reduces."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("tp",))
    rng = np.random.default_rng(0)

    def on_mesh(fn):  # carry [T·B, H], rank r's rows at r
        return jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))

    def psum(carry, _):
        return on_mesh(lambda x: reference.all_reduce(x, "tp"))(carry)

    times = {}
    mailbox = None if args.psum_only else k3.Mailbox.for_devices(devices)
    for b in map(int, args.batches.split(",")):
        rows = jax.device_put(
            jnp.asarray(rng.standard_normal((len(devices) * b, H), np.float32), jnp.bfloat16),
            NamedSharding(mesh, P("tp")))
        columns = {"psum": psum}
        if mailbox is not None:
            for name, two_shot in (("one_shot", False), ("two_shot", True)):
                def lamport(carry, _, two_shot=two_shot):  # two layers
                    for _ in range(2):
                        carry = on_mesh(lambda x: k3.all_reduce(
                            x, mailbox, axis_name="tp", two_shot=two_shot))(carry)
                    return carry
                columns[name] = lamport
        times[b] = {name: time_per_call(step, rows, [None] * args.sets)
                    / (1 if name == "psum" else 2) for name, step in columns.items()}
    if mailbox is not None:
        mailbox.check()
        mailbox.close()
    return times


def mesh_mode(args):
    times = mesh_times(args)
    if args.psum_only:
        print(json.dumps(times))
        return
    one_shot_xla = with_xla_one_shot(__spec__.name, ["--mode", "mesh", "--psum-only", "--batches",
                                                 args.batches, "--sets", str(args.sets)], "psum")
    tp = len(jax.devices())
    rows = [dict(tp=tp, batch=b, one_shot_us=t["one_shot"], two_shot_us=t["two_shot"],
                 psum_us=t["psum"], xla_one_shot_us=one_shot_xla.get(b, float("nan")),
                 speedup_vs_psum=t["psum"] / min(t["one_shot"], t["two_shot"]))
            for b, t in times.items()]
    report.write(args.out, "bench_all_reduce_mesh", report.meta(), rows,
                 f"Mailbox all-reduce on a TP{tp} mesh vs psum (NCCL) and XLA's one-shot kernel", [
                     ("TP", "{tp}"), ("B", "{batch}"), ("one-shot µs", "{one_shot_us:.2f}"),
                     ("two-shot µs", "{two_shot_us:.2f}"), ("psum µs", "{psum_us:.2f}"),
                     ("XLA one-shot µs", "{xla_one_shot_us:.2f}"),
                     ("best vs psum", "{speedup_vs_psum:.2f}x")])


def virtual_mode(args):
    rng = np.random.default_rng(0)
    rows = []
    for tp in map(int, args.tps.split(",")):
        with k3.Mailbox.virtual(jax.devices()[0], tp) as mailbox:
            for b in map(int, args.batches.split(",")):
                sets = [jnp.asarray(rng.standard_normal((tp, b, H), np.float32), jnp.bfloat16)
                        for _ in range(args.sets)]

                def lamport(carry, partials, two_shot):  # carry: a sum of one word of each
                    # result, so no call is dead; calls on one stream run one after another
                    out = k3.all_reduce_virtual(partials, mailbox, two_shot=two_shot)
                    return carry + out[0, 0, 0].astype(jnp.float32)

                def xla(carry, partials):  # 0·carry: the same order, fused for free
                    x = partials.astype(jnp.float32) + 0 * carry.astype(jnp.float32)[None]
                    return jnp.sum(x, 0).astype(jnp.bfloat16)

                row = dict(tp=tp, batch=b)
                for name, step, carry in (
                        ("one_shot_us", lambda c, p: lamport(c, p, False), jnp.float32(0)),
                        ("two_shot_us", lambda c, p: lamport(c, p, True), jnp.float32(0)),
                        ("xla_sum_us", xla, sets[0][0])):
                    row[name] = time_per_call(step, carry, sets)
                mailbox.check()
                rows.append(row)
    report.write(args.out, "bench_all_reduce_virtual", report.meta(), rows,
                 "Virtual-TP mailbox all-reduce vs XLA sum on one device", [
                     ("TP", "{tp}"), ("B", "{batch}"), ("one-shot µs", "{one_shot_us:.2f}"),
                     ("two-shot µs", "{two_shot_us:.2f}"), ("XLA sum µs", "{xla_sum_us:.2f}")])


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_all_reduce needs a GPU")
    mode = args.mode or ("mesh" if len(jax.devices()) > 1 else "virtual")
    (mesh_mode if mode == "mesh" else virtual_mode)(args)


if __name__ == "__main__":
    main()
