"""Benchmark: Kimi K3's post-attention tail, kernels against XLA, in two parts.

oproj (one GPU): the o_proj producer kernel (`kernels.producer_ops.project`) against XLA's dot
  and cuBLAS (torch in a CUDA graph, where torch is installed) for one rank's weight
  [7168, 12288/TP], per B: µs per call (the x wait included) and the producer kernel's own
  GPU µs, each as a share of the read bandwidth measured in the same run (the floor: the
  weight read once), and against the same-size read: the fastest of an XLA reduction over the
  weight's own bytes and the stream-read kernels of benchmarks/read_floor.py (what a chain of
  calls that each read that much costs, launch and ramp included).
tail (a TP mesh of every local GPU): the kernel tail (`oproj_attn_res` with a mailbox:
  producer + AttnRes consumer) against the XLA reference (dot + psum + reference AttnRes),
  and on several GPUs the reference with XLA's one-shot all-reduce kernel (a child process,
  as in bench_all_reduce.py) and what the one-rank model predicts for the mesh: rank 0 of a
  group of this TP on one GPU with ghost peers (benchmarks/bench_rank.py) in the table's
  variant, plus the cost model's NVLink transfer (the model leaves out the ~1 µs fusion that
  makes x wait, which the mesh's figure holds). Each timed call runs two layers (two mailbox
  calls) with their own o_proj weights; the AttnRes is a delta layer over K = 8 saved
  blocks.
tail --variants fused,split[,xla,two_shot]: the kernel tail's variants side by side, per (TP, B), with
  the choice of `tuning.TAIL_VARIANTS` beside them (the numbers that table wants): on several
  GPUs on the mesh of all of them (each rank's own launch), on one GPU in virtual TP for each
  of --tps (every rank's mailbox on the one GPU and every rank's work in one chain: the fused
  variant is one launch for all ranks, the others 2·TP launches, so the µs are a whole TP
  group's, not one rank's; they rank the variants by launch count and overlap, not by NVLink).
Each call's x waits for the previous call's result (x + 0·y[:, :1], as through attention in
decode; a ~1 µs fusion on both sides), and the input sets together overflow the L2. Writes bench_layer_oproj/_tail .json and .md to --out.

    python -m benchmarks.bench_layer --out /tmp/bench
    python -m benchmarks.bench_layer --parts tail --variants fused,split,xla --batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from benchmarks import report
from benchmarks.read_floor import read_floor_us
from benchmarks.timing import (cublas_per_call, profile_per_call, read_bandwidth,
                               time_per_call, with_xla_one_shot)
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs

CFG = k3.KIMI_K3
H, K_TOTAL, NB = CFG.hidden_size, CFG.o_proj_in_features, CFG.num_attn_res_blocks
NUM_BLOCKS = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="oproj,tail")
    parser.add_argument("--batches", default="1,2,8,16,64")
    parser.add_argument("--tps", default="1,2,4,8,16", help="oproj part: K = 12288 / TP")
    parser.add_argument("--sets", type=int, default=4, help="input sets (two layers each)")
    parser.add_argument("--variants", default="",
                        help="tail part: also time these kernel tail variants side by side "
                             "(of fused,split,xla; two_shot: split with the two-shot all-reduce)")
    parser.add_argument("--plot", nargs="+", metavar="JSON",
                        help="only draw bench_layer.png in --out from these recorded results")
    parser.add_argument("--reference-only", action="store_true",
                        help="time the reference alone and print JSON (the child process)")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def oproj_rows(args, bandwidth):
    """The producer, XLA's dot and cuBLAS (torch, where installed) per (TP, B) on one GPU, with
    the producer's share of the read bandwidth."""
    from jax_kimik3.kernels import producer_ops as producer

    rng = np.random.default_rng(0)
    rows = []
    for tp in map(int, args.tps.split(",")):
        k = K_TOTAL // tp
        weight_bytes = H * k * 2
        count = max(2, -(-(256 << 20) // weight_bytes))  # weights past the 60 MB L2
        weights = [jax.device_put(oproj_inputs(rng, 1, k)[1]) for _ in range(count)]
        read_us = min(1e6 * weight_bytes / read_bandwidth(weight_bytes, count),  # same bytes
                      read_floor_us(weights))
        for b in map(int, args.batches.split(",")):
            sets = [(jnp.asarray(rng.standard_normal((b, k), np.float32), jnp.bfloat16), w)
                    for w in weights]

            def step(carry, xw, project):  # x waits for the last call (a ~1 µs fusion)
                return project(xw[0] + 0 * carry[:, :1], xw[1])

            carry = jnp.zeros((b, H), jnp.bfloat16)
            profiles = {name: profile_per_call(lambda c, xw, f=f: step(c, xw, f), carry, sets)
                        for name, f in (("producer", producer.project),
                                        ("xla_dot", reference.oproj_partial))}
            kernel = producer_kernel_us(profiles["producer"])
            cublas = cublas_per_call(b, k, H, count)
            floor = 1e6 * weight_bytes / bandwidth
            span = profiles["producer"].span_us
            rows.append(dict(tp=tp, k=k, batch=b, producer_us=span, producer_kernel_us=kernel,
                             xla_dot_us=profiles["xla_dot"].span_us,
                             cublas_us=float("nan") if cublas is None else cublas,
                             speedup=profiles["xla_dot"].span_us / span,
                             kernel_of_read=floor / kernel, of_read=floor / span, floor_us=floor,
                             read_us=read_us, of_same_read=read_us / span,
                             kernel_of_same_read=read_us / kernel,
                             kernels={name: p.kernel_us for name, p in profiles.items()}))
    return rows


def producer_kernel_us(profile):
    """The producer kernel's own GPU µs per call in a chain's profile (its name has the class's)."""
    times = [us for name, us in profile.kernel_us.items() if "OprojProducer" in name]
    if len(times) != 1:
        raise RuntimeError(f"expected one producer kernel, found {sorted(profile.kernel_us)}")
    return times[0]


def tail_times(args):
    """{B: {"kernel"|"reference": µs per layer}} on a mesh of every local GPU."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("tp",))
    split = NamedSharding(mesh, P(None, "tp"))
    rng = np.random.default_rng(0)
    mailbox = None if args.reference_only else k3.Mailbox.for_devices(devices)
    weights = [jax.device_put(oproj_inputs(rng, 1)[1], split) for _ in range(2 * args.sets)]
    times = {}
    for b in map(int, args.batches.split(",")):
        inp = jax.device_put(attn_res_inputs(rng, b, NB), NamedSharding(mesh, P()))
        xs = [jax.device_put(jnp.asarray(rng.standard_normal((b, K_TOTAL), np.float32),
                                         jnp.bfloat16), split) for _ in weights]
        sets = [[a for layer in (2 * i, 2 * i + 1) for a in (xs[layer], weights[layer])]
                for i in range(args.sets)]

        def step(carry, layer_inputs, backend):
            def layers(prefix, out, x0, w0, x1, w1):
                for x, w in ((x0, w0), (x1, w1)):
                    # As in decode, this layer's x waits for the last layer's out (through
                    # attention): XLA cannot run this o_proj early, under the last all-reduce.
                    x = x + 0 * out[:, :1]
                    out, prefix, _ = k3.oproj_attn_res(
                        x, w, prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                        inp.out_norm_w, axis_name="tp", num_blocks=NUM_BLOCKS, has_delta=True,
                        mailbox=mailbox if backend == "kernel" else None, backend=backend)
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


def mesh_model_us(args, tp, bandwidth):
    """{B: µs} that the one-rank model predicts for one layer's tail on a TP `tp` mesh
    (`bench_rank.model_us`), measured on this process's first GPU."""
    from benchmarks import bench_rank

    variants = {bench_rank.table_choice(b, K_TOTAL // tp, tp)
                for b in map(int, args.batches.split(","))}
    rank_args = argparse.Namespace(batches=args.batches, variants=",".join(sorted(variants)),
                                   sets=args.sets)
    return {row["batch"]: row["model_us"]
            for row in bench_rank.rank_rows(rank_args, tp, bandwidth)}


def variant_rows(args):
    """µs per layer of each of --variants per (TP, B): the mesh of every local GPU, or on one
    GPU virtual TP at each of --tps. Each row also names the fastest and the table's choice."""
    from jax_kimik3 import tuning
    from jax_kimik3.kernels import oproj

    variants = args.variants.split(",")
    devices = jax.devices()
    rng = np.random.default_rng(0)
    rows = []
    on_mesh = len(devices) > 1
    for tp in [len(devices)] if on_mesh else map(int, args.tps.split(",")):
        k = K_TOTAL // tp
        mailbox = (k3.Mailbox.for_devices(devices) if on_mesh
                   else k3.Mailbox.virtual(devices[0], tp))
        table = jnp.asarray(mailbox.peer_table)
        if on_mesh:
            mesh = Mesh(np.array(devices), ("tp",))
            place = NamedSharding(mesh, P(None, "tp"))
            shard = lambda a: jax.device_put(a, place)  # noqa: E731
        else:  # [.., K] → [TP, .., K / TP]: each rank's shard, stacked
            shard = lambda a: jax.device_put(  # noqa: E731
                jnp.moveaxis(jnp.asarray(a).reshape(*a.shape[:-1], tp, k), -2, 0))
        weights = [shard(oproj_inputs(rng, 1)[1]) for _ in range(2 * args.sets)]
        for b in map(int, args.batches.split(",")):
            inp = jax.device_put(attn_res_inputs(rng, b, NB),
                                 NamedSharding(mesh, P()) if on_mesh else None)
            xs = [shard(np.asarray(jnp.asarray(rng.standard_normal((b, K_TOTAL), np.float32),
                                               jnp.bfloat16))) for _ in weights]
            sets = [[a for layer in (2 * i, 2 * i + 1) for a in (xs[layer], weights[layer])]
                    for i in range(args.sets)]

            def layers(variant, rank, prefix, out, x0, w0, x1, w1):
                for x, w in ((x0, w0), (x1, w1)):
                    x = x + 0 * out[..., :1]  # this layer waits for the last one (decode)
                    two_shot = variant == "two_shot"
                    if rank is not None:  # a mesh rank: one rank per launch
                        x, w = x[None], w[None]
                    ranks = (jnp.arange(tp, dtype=jnp.int32) if rank is None else rank)
                    outs, prefixes = oproj.tail(
                        x, w, prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                        inp.out_norm_w, table=table, ranks=ranks, spec=mailbox.spec,
                        num_blocks=NUM_BLOCKS, has_delta=True, eps=1e-5, out_eps=1e-5,
                        variant="split" if two_shot else variant, two_shot=two_shot)
                    out, prefix = outs[0], prefixes[0]
                return prefix, out

            def step(carry, layer_inputs, variant):
                if not on_mesh:
                    return layers(variant, None, *carry, *layer_inputs)
                return jax.shard_map(
                    lambda *a: layers(variant, jax.lax.axis_index("tp").astype(jnp.int32)
                                      .reshape(1), *a),
                    mesh=mesh, in_specs=(P(), P()) + (P(None, "tp"),) * 4,
                    out_specs=(P(), P()))(*carry, *layer_inputs)

            carry = (inp.prefix, inp.prefix)
            times = {v: time_per_call(lambda c, s, v=v: step(c, s, v), carry, sets) / 2
                     for v in variants}
            mailbox.check()
            rows.append(dict(mode="mesh" if on_mesh else "virtual", tp=tp, k=k, batch=b,
                             table=tuning.tail_variant(b, k), best=min(times, key=times.get),
                             **{f"{v}_us": t for v, t in times.items()}))
        mailbox.close()
    return rows


def plot(out, results):
    """bench_layer.png: o_proj share of read bandwidth per B (producer, XLA's dot) for each K,
    and the tail's µs per B (kernels, reference) for each TP. `results`: loaded JSON records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for record in results:
        rows, meta = record["rows"], record["meta"]
        if "producer_us" in rows[0]:
            for i, k in enumerate(sorted({r["k"] for r in rows})):
                mine = [r for r in rows if r["k"] == k]
                batches = [r["batch"] for r in mine]
                left.plot(batches, [r["of_read"] for r in mine], "o-", color=f"C{i}",
                          label=f"producer K={k}")
                left.plot(batches, [r["of_read"] * r["producer_us"] / r["xla_dot_us"]
                                    for r in mine], "x--", color=f"C{i}", label=f"XLA dot K={k}")
        elif "kernel_us" in rows[0]:
            tp = rows[0]["tp"]
            batches = [r["batch"] for r in rows]
            right.plot(batches, [r["kernel_us"] for r in rows], "o-", label=f"kernels TP{tp}")
            right.plot(batches, [r["reference_us"] for r in rows], "x--",
                       label=f"reference TP{tp}")
    left.set(xscale="log", xlabel="B (tokens per rank)", ylabel="share of read bandwidth",
             title="o_proj, one rank's [7168, K] weight")
    right.set(xscale="log", xlabel="B (tokens per rank)", ylabel="µs per layer",
              title="post-attention tail (o_proj + all-reduce + AttnRes)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta['gpu']}, {meta['date']}, jax {meta['jax']}")
    fig.tight_layout()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "bench_layer.png", dpi=110)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        plot(args.out, [json.loads(pathlib.Path(p).read_text()) for p in args.plot])
        return
    if jax.default_backend() != "gpu":
        sys.exit("bench_layer needs a GPU")
    if args.reference_only:
        print(json.dumps(tail_times(args)))
        return
    bandwidth = read_bandwidth()
    info = report.meta(read_bandwidth_tbps=bandwidth / 1e12)
    parts = args.parts.split(",")
    if "oproj" in parts:
        report.write(args.out, "bench_layer_oproj", info, oproj_rows(args, bandwidth),
                     f"o_proj producer vs XLA's dot, one rank's [7168, K] weight "
                     f"(read {bandwidth / 1e12:.2f} TB/s)", [
                         ("TP", "{tp}"), ("K", "{k}"), ("B", "{batch}"),
                         ("producer µs", "{producer_us:.2f}"), ("XLA dot µs", "{xla_dot_us:.2f}"),
                         ("cuBLAS µs", "{cublas_us:.2f}"), ("speedup", "{speedup:.2f}x"),
                         ("of read BW", "{of_read:.0%}"),
                         ("producer kernel µs", "{producer_kernel_us:.2f}"),
                         ("kernel of read BW", "{kernel_of_read:.0%}"),
                         ("same-size read µs", "{read_us:.2f}"),
                         ("producer µs of it", "{of_same_read:.0%}"),
                         ("kernel of it", "{kernel_of_same_read:.0%}"),
                         ("floor µs", "{floor_us:.2f}")])
    if "tail" in parts:
        times = tail_times(args)
        tp = len(jax.devices())
        one_shot_xla = with_xla_one_shot(__spec__.name, [
            "--reference-only", "--batches", args.batches, "--sets", str(args.sets)],
            "reference") if tp > 1 else {}
        floor = 1e6 * H * (K_TOTAL // tp) * 2 / bandwidth  # this rank's weight, read once
        rows = [dict(tp=tp, batch=b, kernel_us=t["kernel"], reference_us=t["reference"],
                     reference_one_shot_us=one_shot_xla.get(b, float("nan")),
                     speedup=t["reference"] / t["kernel"], floor_us=floor)
                for b, t in times.items()]
        title = f"Post-attention tail per layer, kernels vs XLA reference, TP{tp} mesh"
        columns = [("TP", "{tp}"), ("B", "{batch}"), ("kernel tail µs", "{kernel_us:.2f}"),
                   ("reference µs", "{reference_us:.2f}"),
                   ("reference + XLA one-shot µs", "{reference_one_shot_us:.2f}"),
                   ("speedup", "{speedup:.2f}x"), ("o_proj floor µs", "{floor_us:.2f}")]
        report.write(args.out, "bench_layer_tail", info, rows, title, columns)
        if tp > 1:  # written again with the one-rank model's prediction beside the mesh
            model = mesh_model_us(args, tp, bandwidth)
            for row in rows:
                row["model_us"] = model[row["batch"]]
                row["of_model"] = row["kernel_us"] / row["model_us"]
            report.write(args.out, "bench_layer_tail", info, rows, title, columns + [
                ("one-rank model µs", "{model_us:.2f}"), ("mesh / model", "{of_model:.2f}")])
    if "tail" in parts and args.variants:
        rows = variant_rows(args)
        report.write(args.out, "bench_layer_tail_variants", info, rows,
                     "Post-attention tail per layer by kernel variant (tuning.TAIL_VARIANTS)", [
                         ("mode", "{mode}"), ("TP", "{tp}"), ("K", "{k}"), ("B", "{batch}"),
                         *((f"{v} µs", f"{{{v}_us:.2f}}") for v in args.variants.split(",")),
                         ("fastest", "{best}"), ("table", "{table}")])
    try:
        plot(args.out, [json.loads(p.read_text())
                        for p in sorted(pathlib.Path(args.out).glob("bench_layer_*.json"))])
    except ImportError:
        print("matplotlib is not installed: no bench_layer.png", file=sys.stderr)

if __name__ == "__main__":
    main()
