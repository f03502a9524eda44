"""The kernel workload that `scripts/device_checks.sh sanitize` runs under compute-sanitizer:
every kernel family at a few shapes in virtual TP on one GPU, each result checked against the
reference and every mailbox checked for timeouts. Prints one line per case and a last line
with the count of cases and failures.

    compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py --tps 2,8
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kimik3 as k3
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs

CFG = k3.KIMI_K3
H, NB = CFG.hidden_size, CFG.num_attn_res_blocks
KINDS = ("attn_res", "statistics", "producer", "all_reduce", "two_shot", "split", "xla",
         "fused")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tps", default="2,8")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    parser.add_argument("--timeout-ms", type=float, default=60_000.0,
                        help="the mailboxes' wait bound (the tools slow kernels down)")
    return parser.parse_args(argv)


def attn_res_case(rng, b):
    inp = jax.device_put(attn_res_inputs(rng, b, NB))
    args = (inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)
    got = k3.attn_res(*args, num_blocks=4, delta=inp.delta, write_idx=5, backend="kernel")[0]
    want = reference.attn_res(*args, num_blocks=4, delta=inp.delta, write_idx=5)[0]
    return reference.relative_error(got, want)


def statistics_case(rng, b):
    inp = jax.device_put(attn_res_inputs(rng, b, NB))
    got = k3.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w, num_blocks=8,
                                 backend="kernel")
    want = reference.attn_res_statistics(inp.blocks, inp.res_norm_w, inp.res_proj_w,
                                         num_blocks=8, eps=CFG.rms_norm_eps)
    return reference.relative_error(got.mixture, want[0])


def producer_case(rng, b, tp):
    """One rank's o_proj rows (K = 12288 / TP) on the producer kernel alone."""
    from jax_kimik3.kernels import producer_ops

    x, w = (a[..., : a.shape[-1] // tp] for a in oproj_inputs(rng, b))
    got = jax.jit(producer_ops.project)(x, w)
    return reference.relative_error(got, reference.oproj_partial(x, w))


def all_reduce_case(rng, b, mailbox, two_shot):
    partials = jnp.asarray(rng.standard_normal((mailbox.tp, b, H)), jnp.bfloat16)
    got = k3.all_reduce_virtual(partials, mailbox, two_shot=two_shot)
    return reference.relative_error(got[0], reference.all_reduce_ranks(partials))


def tail_case(rng, b, mailbox, variant):
    from jax_kimik3.kernels import oproj

    tp = mailbox.tp
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    xs, ws = (jnp.moveaxis(jnp.asarray(a).reshape(*a.shape[:-1], tp, -1), -2, 0)
              for a in (x, w))
    args = (inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)
    got = jax.jit(lambda xs, ws, t: oproj.tail(
        xs, ws, *args, table=t, ranks=jnp.arange(tp, dtype=jnp.int32), spec=mailbox.spec,
        num_blocks=4, has_delta=True, eps=CFG.rms_norm_eps, out_eps=CFG.rms_norm_eps,
        variant=variant))(xs, ws, jnp.asarray(mailbox.peer_table))[0]
    want = reference.oproj_attn_res_virtual(xs, ws, *args, num_blocks=4, has_delta=True)[0]
    return reference.relative_error(got[0], want)


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("sanitize_kernels needs a GPU")
    rng = np.random.default_rng(0)
    kinds = args.kinds.split(",")
    cases, failures = 0, 0

    def report(what, run):
        nonlocal cases, failures
        cases += 1
        try:
            rel = run()
            ok = rel < 2e-2
            print(f"{what}: relative L2 {rel:.2e}{'' if ok else ' TOO FAR'}", flush=True)
        except Exception as e:  # noqa: BLE001 - a case that raises is a failure, reported
            ok = False
            print(f"{what}: {type(e).__name__}: {e}"[:400], flush=True)
        failures += not ok

    for b in map(int, args.batches.split(",")):
        if "attn_res" in kinds:
            report(f"attn_res B={b}", lambda: attn_res_case(rng, b))
        if "statistics" in kinds:
            report(f"statistics B={b}", lambda: statistics_case(rng, b))
    for tp in map(int, args.tps.split(",")):
        for b in map(int, args.batches.split(",")):
            if "producer" in kinds:
                report(f"producer TP{tp} B={b}", lambda: producer_case(rng, b, tp))
        with k3.Mailbox.virtual(jax.devices()[0], tp, timeout_ms=args.timeout_ms) as mailbox:
            for b in map(int, args.batches.split(",")):
                for kind in ("all_reduce", "two_shot"):
                    if kind in kinds:
                        report(f"{kind} TP{tp} B={b}",
                               lambda: all_reduce_case(rng, b, mailbox, kind == "two_shot"))
                for kind in ("split", "xla", "fused"):
                    if kind in kinds:
                        report(f"{kind} tail TP{tp} B={b}",
                               lambda: tail_case(rng, b, mailbox, kind))
            try:
                mailbox.check()
                print(f"mailbox TP{tp}: healthy, every slot armed: {mailbox.unarmed() == 0}")
                failures += mailbox.unarmed() != 0
            except TimeoutError as e:
                failures += 1
                print(f"mailbox TP{tp}: {e}")
    print(f"sanitize_kernels: {cases} cases, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
