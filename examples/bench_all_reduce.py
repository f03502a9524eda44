"""Benchmark: the Lamport all-reduce in virtual TP (every rank on one GPU) against XLA's sum.

One step = every rank's producer, [every owner,] every consumer, for partials [TP, B, H];
the baseline is the same sum done by XLA on the one device (fp32 over ranks, bf16 out). On a
single GPU this measures the protocol's cost (all TP ranks' traffic lands on one GPU), not
NVLink. Writes bench_all_reduce.json and .md to --out.

    python examples/bench_all_reduce.py --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import jax_kimik3 as k3  # noqa: E402
from timing import time_per_call  # noqa: E402

H = k3.KIMI_K3.hidden_size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tps", default="2,4,8,16")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--sets", type=int, default=16, help="input sets, one per call")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_all_reduce needs a GPU")
    rng = np.random.default_rng(0)
    rows = []
    for tp in map(int, args.tps.split(",")):
        with k3.Mailbox.virtual(jax.devices()[0], tp) as mailbox:
            for b in map(int, args.batches.split(",")):
                sets = [jnp.asarray(rng.standard_normal((tp, b, H), np.float32), jnp.bfloat16)
                        for _ in range(args.sets)]

                def lamport(carry, partials, two_shot):  # carry: the last step's [TP, B, H]
                    return k3.all_reduce_virtual(partials, mailbox, parity=0, two_shot=two_shot,
                                                 after=carry)

                def xla(carry, partials):  # 0·carry: the same order, fused for free
                    x = partials.astype(jnp.float32) + 0 * carry.astype(jnp.float32)[None]
                    return jnp.sum(x, 0).astype(jnp.bfloat16)

                row = dict(tp=tp, batch=b)
                for name, step, carry in (
                        ("one_shot_us", lambda c, p: lamport(c, p, False), sets[0]),
                        ("two_shot_us", lambda c, p: lamport(c, p, True), sets[0]),
                        ("xla_sum_us", xla, sets[0][0])):
                    row[name] = time_per_call(step, carry, sets)
                mailbox.check()
                rows.append(row)
    meta = dict(date=datetime.date.today().isoformat(), gpu=jax.devices()[0].device_kind,
                jax=jax.__version__)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_all_reduce.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"Virtual-TP Lamport all-reduce vs XLA sum on one device: {meta['gpu']}, "
             f"{meta['date']}, jax {meta['jax']}", "",
             "| TP | B | one-shot µs | two-shot µs | XLA sum µs |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['batch']} | {r['one_shot_us']:.2f} | "
                     f"{r['two_shot_us']:.2f} | {r['xla_sum_us']:.2f} |")
    text = "\n".join(lines)
    (out / "bench_all_reduce.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
