"""Benchmark: the post-attention tail as one rank of a TP mesh does it, on one GPU.

Rank 0 of a TP mailbox (TP 2 and 8 by default; every rank's buffer on this GPU) runs its own
tail call as a mesh rank would (`oproj.tail` with ranks = [0]: its producer and publish into
every rank's slot, the wait for and sum of its TP slots, AttnRes, the re-arm), while ghost
peers (benchmarks/ghost_peers.py) have already delivered the other ranks' rows for that call.
The ghost kernel also hands the tail its x, so the tail's first kernel follows it directly, as
it would follow the attention kernel in a decode step. Per variant (fused; split and xla,
one-shot and two-shot) and B: µs per layer (the chain's span, less the stand-in kernels' own
GPU time), beside XLA's per-rank work on the same device (XLA's dot on x from a copy kernel
that stands in likewise, the add of the peers' rows a psum would bring, the reference
AttnRes), and the NVLink transfer a real mesh would add (the cost model: the bytes this rank
sends at NVLINK_BYTES_PER_S; overlapped with nothing here). Each variant's result is checked
against the float64 model once. The fastest variant per B beside the tuning table's choice.
Writes bench_rank.json (with each variant's kernels' own GPU µs: where the span goes) and .md
to --out.

    python -m benchmarks.bench_rank --out /tmp/bench --batches 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kimik3 as k3
from benchmarks import report
from benchmarks.timing import profile_per_call, read_bandwidth
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs

CFG = k3.KIMI_K3
H, K_TOTAL, NB = CFG.hidden_size, CFG.o_proj_in_features, CFG.num_attn_res_blocks
NUM_BLOCKS = 8
VARIANTS = ("fused", "split", "two_shot", "xla", "xla_two_shot")  # two_shot: split, two-shot
# NVLink4 (H100/H200 SXM): 18 links of 25 GB/s per direction, 450 GB/s out of each GPU.
NVLINK_BYTES_PER_S = 450e9
# Relative L2 error of rank 0's out against the model above which a timed variant is refused:
# a check that the timed call computes the tail (tests/test_gpu_oproj.py holds every variant
# to the float64 model at bf16's bounds).
SANITY_BOUND = 5e-2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tps", default="2,8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sets", type=int, default=8, help="input sets (weights past the L2)")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def nvlink_us(tp, batch, two_shot):
    """µs to send this rank's share over NVLink: one-shot its rows to TP - 1 peers; two-shot
    (TP - 1)/TP of its rows to the owners and its reduced chunk to TP - 1 peers."""
    row_bytes = batch * H * 2
    sent = 2 * (tp - 1) / tp * row_bytes if two_shot else (tp - 1) * row_bytes
    return 1e6 * sent / NVLINK_BYTES_PER_S


def table_choice(batch, k, tp):
    """The variant (of VARIANTS) that the kernel path launches, by the tuning tables, for B =
    `batch` at K = `k` per rank and `tp` ranks."""
    from jax_kimik3.kernels import oproj

    choice = oproj.choose(batch, k, tp, ahead=False)
    if not choice.two_shot:
        return choice.variant
    return "two_shot" if choice.variant == "split" else f"{choice.variant}_two_shot"


def tail_arguments(variant):
    """(variant, two_shot) of `oproj.tail` for one of VARIANTS."""
    two_shot = variant.endswith("two_shot")
    return ("split" if variant == "two_shot" else variant.removesuffix("_two_shot")), two_shot


def model_us(row):
    """One rank's tail on a real mesh as this benchmark models it: the table's variant timed
    here, plus the NVLink transfer of the cost model, overlapped with nothing (NaN where that
    variant was not timed)."""
    nvlink = row["nvlink_two_shot_us" if row["table"].endswith("two_shot")
                 else "nvlink_one_shot_us"]
    return row.get(f"{row['table']}_us", float("nan")) + nvlink


def span_us(profile):
    """A call's GPU span less its stand-ins' own time (benchmarks/ghost_peers.py)."""
    from benchmarks import ghost_peers

    return profile.span_us - sum(us for name, us in profile.kernel_us.items()
                                 if ghost_peers.is_stand_in(name))


def rank_rows(args, tp, bandwidth):
    from benchmarks import ghost_peers
    from jax_kimik3.kernels import oproj

    k = K_TOTAL // tp
    device = jax.devices()[0]
    mailbox = k3.Mailbox.virtual(device, tp)
    table = jnp.asarray(mailbox.peer_table)
    rank = jnp.zeros((1,), jnp.int32)
    rng = np.random.default_rng(0)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)  # noqa: E731
    weights = [bf16(1, H, k) * 0.02 for _ in range(args.sets)]
    rows = []
    for b in map(int, args.batches.split(",")):
        inp = jax.device_put(attn_res_inputs(rng, b, NB))
        sets = []
        for w in weights:
            x, ghosts = bf16(1, b, k), bf16(tp - 1, b, H)
            own = reference.oproj_partial(x[0], w[0])
            # The sum every rank gets: rank order, fp32, rounded once (as the kernels add).
            total = (own.astype(jnp.float32) + jnp.sum(ghosts.astype(jnp.float32), 0)
                     ).astype(jnp.bfloat16)
            sets.append(dict(x=x, w=w, ghosts=ghosts, total=total,
                             peers=jnp.sum(ghosts.astype(jnp.float32), 0)))

        def tail(carry, s, variant):
            prefix, out = carry
            kind, two_shot = tail_arguments(variant)
            x = ghost_peers.deliver(s["ghosts"], s["total"], table, s["x"], out,
                                    spec=mailbox.spec, two_shot=two_shot)
            outs, prefixes = oproj.tail(
                x, s["w"], prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                inp.out_norm_w, table=table, ranks=rank, spec=mailbox.spec,
                num_blocks=NUM_BLOCKS, has_delta=True, eps=CFG.rms_norm_eps,
                out_eps=CFG.rms_norm_eps, variant=kind, two_shot=two_shot)
            return prefixes[0], outs[0]

        def xla(carry, s):
            prefix, out = carry
            x = ghost_peers.ready(s["x"][0], out)
            delta = (reference.oproj_partial(x, s["w"][0]).astype(jnp.float32) + s["peers"]
                     ).astype(jnp.bfloat16)  # a psum's result, without the psum
            out, prefix, _ = reference.post_attention(
                delta, prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
                num_blocks=NUM_BLOCKS, has_delta=True, eps=CFG.rms_norm_eps,
                out_eps=CFG.rms_norm_eps)
            return prefix, out

        carry = (inp.prefix, inp.prefix)
        row = dict(tp=tp, k=k, batch=b, table=table_choice(b, k, tp),
                   reference_us=span_us(profile_per_call(xla, carry, sets)),
                   floor_us=1e6 * H * k * 2 / bandwidth)
        for variant in args.variants.split(","):
            step = lambda c, s, v=variant: tail(c, s, v)  # noqa: E731
            # Checked once against the model: rank 0's out after one call.
            got = jax.jit(step)(carry, sets[0])[1]
            want = reference.post_attention(
                sets[0]["total"], inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w,
                inp.out_norm_w, num_blocks=NUM_BLOCKS, has_delta=True,
                eps=CFG.rms_norm_eps, out_eps=CFG.rms_norm_eps)[0]
            error = reference.relative_error(got, want)
            if not error < SANITY_BOUND:
                raise RuntimeError(f"{variant} at B={b}: relative error {error:.3g}")
            profile = profile_per_call(step, carry, sets)
            row[f"{variant}_us"] = span_us(profile)
            # Where the span goes: each of the call's kernels' own GPU µs (the rest: gaps).
            row[f"{variant}_kernels_us"] = {name: us for name, us in profile.kernel_us.items()
                                            if not ghost_peers.is_stand_in(name)}
            # When: each kernel's (start, end) µs from the start of its call's first kernel.
            row[f"{variant}_timeline_us"] = profile.timeline_us
            row[f"{variant}_error"] = error
        mailbox.check()
        times = {v: row[f"{v}_us"] for v in args.variants.split(",")}
        row["best"] = min(times, key=times.get)
        row["speedup"] = row["reference_us"] / times[row["best"]]
        row["nvlink_one_shot_us"] = nvlink_us(tp, b, False)
        row["nvlink_two_shot_us"] = nvlink_us(tp, b, True)
        row["model_us"] = model_us(row)
        rows.append(row)
    mailbox.close()
    return rows


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_rank needs a GPU")
    bandwidth = read_bandwidth()
    info = report.meta(read_bandwidth_tbps=bandwidth / 1e12)
    variants = args.variants.split(",")
    rows = []
    for tp in map(int, args.tps.split(",")):  # written after each TP
        rows += rank_rows(args, tp, bandwidth)
        report.write(args.out, "bench_rank", info, rows,
                     "One TP rank's post-attention tail on one GPU (ghost peers), per layer", [
                         ("TP", "{tp}"), ("B", "{batch}"),
                         *((f"{v} µs", f"{{{v}_us:.2f}}") for v in variants),
                         ("XLA per-rank µs", "{reference_us:.2f}"), ("fastest", "{best}"),
                         ("vs XLA", "{speedup:.2f}x"), ("table", "{table}"),
                         ("NVLink one-shot µs", "{nvlink_one_shot_us:.2f}"),
                         ("NVLink two-shot µs", "{nvlink_two_shot_us:.2f}"),
                         ("table + its NVLink µs", "{model_us:.2f}"),
                         ("o_proj floor µs", "{floor_us:.2f}")])


if __name__ == "__main__":
    main()
