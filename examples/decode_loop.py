"""A jitted decode step over Kimi K3 attention tails, at model sizes, on a TP mesh.

The step is `jax_kimik3.decode`'s: per layer the pre-attention AttnRes, a stand-in for
attention, the post-attention tail `oproj_attn_res` (o_proj + all-reduce + AttnRes) and a
stand-in for the MLP; the final AttnRes closes it. Weights are random. On CPU the mesh is made of host devices and the
step runs the reference; on GPUs it runs the kernels, the all-reduce through peer mailboxes
(their buffers alternate with every call, whatever the layer count), and `--check` compares
its output with the reference step. `--check-every N` reads the mailbox's failure record
every N steps and stops with what it says (a peer that never came, in which call).

    python examples/decode_loop.py --layers 4 --batch 8 --steps 5

Ahead of time: `--export step.bin` writes the kernel step for CUDA (`jax.export`; this works
on a CPU host too: the kernels compile for sm_90a there) and stops; `--load step.bin` runs
that artifact instead of tracing the step, on GPUs, without compiling a kernel (and without
the CuTe DSL: see jax_kimik3/export.py). Kernel runs take JAX_KIMIK3_KERNELS (jit, aot: the
prebuilt library, or auto) and print the time from process start to the first step done.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3.backend import KERNELS_ENV, kernel_mode
from jax_kimik3.decode import init_params, make_step

CFG = k3.KIMI_K3
H, NB = CFG.hidden_size, CFG.num_attn_res_blocks


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc), imports and compiles included."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in ticks
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (1..93)")
    parser.add_argument("--batch", type=int, default=8, help="decode rows per rank (1..64)")
    parser.add_argument("--tp", type=int, default=None, help="TP ranks (default: all devices)")
    parser.add_argument("--virtual-tp", type=int, default=None, metavar="TP",
                        help="every one of TP ranks on one device (virtual TP; for a GPU: "
                             "one mailbox buffer per rank, all on it)")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "kernel", "reference"), default="auto",
                        help="auto: kernels on a GPU, the reference elsewhere")
    parser.add_argument("--check", action="store_true",
                        help="also run the reference step and compare (kernel runs)")
    parser.add_argument("--check-every", type=int, default=10, metavar="N",
                        help="kernel runs: read the mailbox's failure record every N steps "
                             "(Mailbox.check); 0: only after the last step")
    parser.add_argument("--stats-ahead", action="store_true",
                        help="each post-attention tail also computes the next call site's "
                             "block statistics (statistics ahead); that call then reads no block")
    parser.add_argument("--export", metavar="FILE", help="write the kernel step for CUDA, stop")
    parser.add_argument("--load", metavar="FILE", help="run the step exported to FILE")
    return parser.parse_args(argv)


def export_step(path, mesh, params, embedding, blocks, num_layers, virtual_tp=None):
    """Write the kernel step for CUDA to `path`, the peer table an operand."""
    from jax_kimik3 import export

    ranks = virtual_tp or mesh.size
    spec = k3.MailboxSpec(k3.MailboxLayout(ranks))
    step = make_step(mesh, params, num_layers, "kernel", spec, virtual_tp=virtual_tp)
    table = jax.ShapeDtypeStruct((ranks + 1, 2), jnp.uint32, sharding=NamedSharding(mesh, P()))
    exported = export.export(step, params, embedding, blocks, table)
    data = exported.serialize()
    with open(path, "wb") as f:
        f.write(data)
    kernels = exported.mlir_module().count(f"custom_call @{export.FFI_TARGET}")
    print(f"exported the {num_layers}-layer kernel step for {exported.nr_devices} CUDA devices "
          f"({kernels} kernel custom calls, each carrying its kernel): "
          f"{len(data) / 2**10:.0f} KiB to {path}")


def report_mailbox(mailbox, step):
    """Mailbox.check after `step` steps: say what the failure record holds, and stop on one."""
    try:
        mailbox.check()
    except TimeoutError as e:
        raise SystemExit(f"mailbox failed by step {step}: {e}") from None
    calls = mailbox.calls()
    print(f"mailbox after step {step}: healthy, {calls[0]} all-reduces per rank since armed")


def main(argv=None):
    args = parse_args(argv)
    # Host devices for a CPU mesh (read when the CPU backend starts; GPUs ignore it).
    jax.config.update("jax_num_cpu_devices", args.tp or 8)
    if not 1 <= args.layers <= CFG.num_layers:
        raise ValueError(f"--layers={args.layers} must be in [1, {CFG.num_layers}]")
    tp = args.tp or (1 if args.virtual_tp else len(jax.devices()))
    if tp > len(jax.devices()):
        raise ValueError(f"--tp={tp} exceeds the {len(jax.devices())} available devices")
    if args.virtual_tp and tp != 1:
        raise ValueError(f"--virtual-tp={args.virtual_tp} puts every rank on one device; "
                         f"got --tp={tp}")
    if args.virtual_tp:
        CFG.o_proj_local_features(args.virtual_tp)  # a ValueError unless TP divides K
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    key = jax.random.key(args.seed)
    params = init_params(key, mesh, args.layers, args.virtual_tp)
    rows = jax.random.normal(jax.random.fold_in(key, 1), (args.steps + 1, args.batch, H))
    embeddings = (0.05 * rows).astype(jnp.bfloat16)  # one fresh token row set per step
    blocks = jnp.zeros((args.batch, NB, H), jnp.bfloat16)

    if args.export:
        return export_step(args.export, mesh, params, embeddings[0], blocks, args.layers,
                           args.virtual_tp)
    on_gpu = jax.devices()[0].platform == "gpu"
    kernels = args.load or args.backend == "kernel" or (args.backend == "auto" and on_gpu)
    if kernels and not on_gpu:
        raise ValueError("kernel steps need GPUs (the mailbox lives in GPU memory)")
    mailbox = None
    if kernels:
        mailbox = (k3.Mailbox.virtual(jax.devices()[0], args.virtual_tp) if args.virtual_tp
                   else k3.Mailbox.for_devices(mesh.devices.flat))
    table = None if mailbox is None else jax.device_put(mailbox.peer_table,
                                                        NamedSharding(mesh, P()))
    ready = process_seconds()  # imports, weights and mailbox in place
    if args.load:
        from jax_kimik3 import export

        with open(args.load, "rb") as f:
            # Under jit, calls take JAX's compiled fast path, not the primitive's dispatch.
            step = jax.jit(export.load(f.read()).call)
    else:
        step = make_step(mesh, params, args.layers, args.backend,
                         None if mailbox is None else mailbox.spec, args.stats_ahead,
                         args.virtual_tp)
    out, _ = step(params, embeddings[0], blocks, table)  # compile and warm up
    out.block_until_ready()
    source = ("exported step" if args.load else f"kernels, {KERNELS_ENV}={kernel_mode()}"
              if kernels else "reference")
    done = process_seconds()
    print(f"startup ({source}): process start to first decode step done: {done:.1f} s "
          f"(imports, weights, mailbox {ready:.1f} s; compile and first step "
          f"{done - ready:.1f} s)")
    times, outs = [], []
    for s in range(1, args.steps + 1):
        start = time.perf_counter()
        out, _ = step(params, embeddings[s], blocks, table)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
        outs.append(out)
        if mailbox is not None and args.check_every and s % args.check_every == 0:
            report_mailbox(mailbox, s)
    checksum = sum(float(jnp.sum(out.astype(jnp.float32))) for out in outs)
    path = ("exported kernels" if args.load else "kernels") if kernels else "reference"
    ranks = f"TP {args.virtual_tp} (virtual)" if args.virtual_tp else f"TP {tp}"
    print(f"decode step: {args.layers} layers, batch {args.batch}, {ranks} on "
          f"{jax.devices()[0].platform} ({path}): median {1e3 * np.median(times):.2f} ms over "
          f"{args.steps} steps")
    print(f"checksum {checksum:.6e}")
    if mailbox is not None:
        report_mailbox(mailbox, args.steps)
        if args.check:
            reference = make_step(mesh, params, args.layers, "reference", None,
                                  virtual_tp=args.virtual_tp)
            rels = []
            for s, out in enumerate(outs, 1):  # every timed step: a race shows in any of them
                want, _ = reference(params, embeddings[s], blocks, None)
                got, want = (np.asarray(a, np.float32) for a in (out, want))
                rels.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
            # Kernels and reference sum in other orders, so an AttnRes output element may land
            # one bf16 ulp (2**-8 relative) apart; each layer can add that much again.
            bound = (args.layers + 1) * 2.0**-8
            worst = max(rels)
            print(f"check against the reference step: relative L2 difference {worst:.2e} at "
                  f"worst over {len(rels)} steps, median {np.median(rels):.2e} "
                  f"(bound {bound:.2e})")
            if not worst < bound:
                raise SystemExit(f"kernel step differs from the reference: {worst:.2e} >= "
                                 f"{bound:.2e}")
        mailbox.close()


if __name__ == "__main__":
    main()
