"""A jitted decode step over Kimi K3 attention tails, at model sizes, on a TP or (DP, TP) mesh.

The step is `jax_kimik3.decode`'s: per layer the pre-attention AttnRes, a stand-in for
attention, the post-attention tail `oproj_attn_res` (o_proj + all-reduce + AttnRes) and a
stand-in for the MLP; the final AttnRes closes it. Weights are random. On CPU the mesh is made of host devices and the
step runs the reference; on GPUs it runs the kernels, the all-reduce through peer mailboxes
(their buffers alternate with every call, whatever the layer count), and `--check` compares
its output with the reference step. `--check-every N` reads the mailbox's failure record
every N steps and stops with what it says (a peer that never came, in which call).

    python examples/decode_loop.py --layers 4 --batch 8 --steps 5
    python examples/decode_loop.py --dp 2 --tp 4      # two TP groups, each its own mailbox

One process per GPU (or per host), under jax.distributed: start every process with the
coordinator's address, the process count and its own id (or leave all three out where
jax.distributed.initialize() finds them itself, as under SLURM); the mesh is then every
process's devices, and each TP group's mailbox spans the processes of its devices:

    python examples/decode_loop.py --coordinator 10.0.0.1:5555 --processes 2 --process-id 0

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
from jax_kimik3.decode import init_params, make_step, rows_spec, table_shape
from jax_kimik3.mesh_mailbox import table_spec
from jax_kimik3.reference import relative_error
from jax_kimik3.tuning import TAIL_VARIANT_NAMES

CFG = k3.KIMI_K3
H, NB = CFG.hidden_size, CFG.num_attn_res_blocks
ALL_REDUCE = {"table": None, "one-shot": False, "two-shot": True}  # --all-reduce: two_shot=


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc), imports and compiles included."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in ticks
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")


def at_least(low):
    """An argparse type: an int >= `low` (argparse names the flag when it is not)."""
    def parse(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=at_least(1), default=4, help="decoder layers (1..93)")
    parser.add_argument("--batch", type=at_least(1), default=8,
                        help="decode rows per rank (1..64)")
    parser.add_argument("--tp", type=at_least(1), default=None,
                        help="TP ranks per group (default: all devices over --dp)")
    parser.add_argument("--dp", type=at_least(1), default=1,
                        help="data-parallel groups: a ('dp', 'tp') mesh, --batch rows each")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="jax.distributed: the coordinator's address (process 0's host)")
    parser.add_argument("--processes", type=at_least(1), metavar="N",
                        help="jax.distributed: processes")
    parser.add_argument("--process-id", type=at_least(0), metavar="I",
                        help="jax.distributed: this one")
    parser.add_argument("--distributed", action="store_true",
                        help="jax.distributed.initialize() from the environment (SLURM, ...)")
    parser.add_argument("--virtual-tp", type=at_least(1), default=None, metavar="TP",
                        help="every one of TP ranks on one device (virtual TP; for a GPU: "
                             "one mailbox buffer per rank, all on it)")
    parser.add_argument("--steps", type=at_least(1), default=5, help="timed decode steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "kernel", "reference"), default="auto",
                        help="auto: kernels on a GPU, the reference elsewhere")
    parser.add_argument("--check", action="store_true",
                        help="also run the reference step and compare (kernel runs)")
    parser.add_argument("--check-every", type=at_least(0), default=10, metavar="N",
                        help="kernel runs: read the mailbox's failure record every N steps "
                             "(Mailbox.check); 0: only after the last step")
    parser.add_argument("--stats-ahead", action="store_true",
                        help="each post-attention tail also computes the next call site's "
                             "block statistics (statistics ahead); that call then reads no block")
    parser.add_argument("--variant", choices=TAIL_VARIANT_NAMES, default=None,
                        help="kernel runs: every post-attention tail launches this variant "
                             "(default: the measured table, jax_kimik3/tuning.py)")
    parser.add_argument("--all-reduce", choices=tuple(ALL_REDUCE), default="table",
                        help="kernel runs: the tails' all-reduce (default: the measured table)")
    parser.add_argument("--export", metavar="FILE", help="write the kernel step for CUDA, stop")
    parser.add_argument("--load", metavar="FILE", help="run the step exported to FILE")
    return parser.parse_args(argv)


def export_step(path, mesh, params, embedding, blocks, num_layers, virtual_tp=None, **tail):
    """Write the kernel step for CUDA to `path`, the peer table an operand; `tail`: the
    tails' two_shot and variant."""
    from jax_kimik3 import export

    if virtual_tp:
        spec = k3.MailboxSpec(k3.MailboxLayout(virtual_tp))
        table = jax.ShapeDtypeStruct((virtual_tp + 1, 2), jnp.uint32,
                                     sharding=NamedSharding(mesh, P()))
    else:
        tp = mesh.shape["tp"]
        spec = k3.MailboxSpec(k3.MailboxLayout(tp), groups=mesh.size // tp)
        shape = table_shape(mesh, tp)
        table = jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                     sharding=NamedSharding(mesh, table_spec(mesh)))
    step = make_step(mesh, params, num_layers, "kernel", spec, virtual_tp=virtual_tp, **tail)
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
    if isinstance(calls, dict):  # a MeshMailbox: per group this process serves
        calls = next(iter(calls.values()))
    print(f"mailbox after step {step}: healthy, {calls[0]} all-reduces per rank since armed")


def local_sum(out) -> float:
    """Sum of this process's part of `out` (each distinct shard once): no collective, so it
    also works where XLA has none across processes (several processes on one GPU)."""
    seen, total = set(), 0.0
    for shard in out.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in seen:
            seen.add(key)
            total += float(np.asarray(shard.data, np.float32).sum())
    return total


def start_distributed(args) -> int:
    """jax.distributed.initialize from the flags (or the environment), before any device use;
    the number of processes."""
    given = [args.coordinator, args.processes, args.process_id]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        raise ValueError("--coordinator, --processes and --process-id go together (or "
                         "--distributed alone: jax.distributed reads the environment)")
    if args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id)
    elif args.distributed:
        jax.distributed.initialize()
    else:
        return 1
    from jax._src import distributed  # the count, before a backend starts (jax.process_count)

    return distributed.global_state.num_processes


def main(argv=None):
    args = parse_args(argv)
    if args.export:  # the kernels' target, also on a host without a GPU (read by the DSL)
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    for flag, tp in (("--tp", args.tp), ("--virtual-tp", args.virtual_tp)):
        if tp:
            CFG.o_proj_local_features(tp, flag)  # a ValueError naming the flag unless TP divides K
    processes = start_distributed(args)
    # Host devices for a CPU mesh, this process's share of it (read when the CPU backend
    # starts, which jax.distributed.initialize does not do; GPUs ignore it).
    if args.tp and args.dp * args.tp % processes:
        raise ValueError(f"--dp={args.dp} x --tp={args.tp} devices do not split evenly over "
                         f"{processes} processes")
    jax.config.update("jax_num_cpu_devices", args.dp * args.tp // processes if args.tp else 8)
    if not 1 <= args.layers <= CFG.num_layers:
        raise ValueError(f"--layers={args.layers} must be in [1, {CFG.num_layers}]")
    devices = jax.devices()  # every process's, under jax.distributed
    tp = args.tp or (1 if args.virtual_tp else len(devices) // args.dp)
    if args.dp * tp > len(devices) or tp < 1:
        raise ValueError(f"--dp={args.dp} groups of --tp={tp} ranks need {args.dp * tp} "
                         f"devices; {len(devices)} are available")
    if args.virtual_tp and (tp != 1 or args.dp != 1 or jax.process_count() > 1):
        raise ValueError(f"--virtual-tp={args.virtual_tp} puts every rank on one device of "
                         f"one process; got --tp={tp}, --dp={args.dp}, "
                         f"{jax.process_count()} processes")
    mesh = (Mesh(np.array(devices[:args.dp * tp]).reshape(args.dp, tp), ("dp", "tp"))
            if args.dp > 1 else Mesh(np.array(devices[:tp]), ("tp",)))
    if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
        raise ValueError(f"the mesh {dict(mesh.shape)} (the first {mesh.size} of "
                         f"{len(devices)} devices) has none of process {jax.process_index()}")
    key = jax.random.key(args.seed)
    params = init_params(key, mesh, args.layers, args.virtual_tp)
    rows = NamedSharding(mesh, rows_spec(mesh))
    batch = args.dp * args.batch  # every group's rows
    embedding = jax.jit(lambda k: (0.05 * jax.random.normal(k, (batch, H))).astype(
        jnp.bfloat16), out_shardings=rows)
    embeddings = [embedding(jax.random.fold_in(key, 1 + s))  # fresh token rows per step
                  for s in range(args.steps + 1)]
    blocks = jax.jit(lambda: jnp.zeros((batch, NB, H), jnp.bfloat16), out_shardings=rows)()

    tail = dict(two_shot=ALL_REDUCE[args.all_reduce], variant=args.variant)
    if args.export:
        return export_step(args.export, mesh, params, embeddings[0], blocks, args.layers,
                           args.virtual_tp, **tail)
    on_gpu = jax.devices()[0].platform == "gpu"
    kernels = args.load or args.backend == "kernel" or (args.backend == "auto" and on_gpu)
    if kernels and not on_gpu:
        raise ValueError("kernel steps need GPUs (the mailbox lives in GPU memory)")
    mailbox = table = None
    if kernels and args.virtual_tp:
        mailbox = k3.Mailbox.virtual(jax.devices()[0], args.virtual_tp)
        table = jax.device_put(mailbox.peer_table, NamedSharding(mesh, P()))
    elif kernels:  # one mailbox per TP group; each device's peer table its own block
        mailbox = k3.MeshMailbox(mesh, "tp")
        table = mailbox.table
    ready = process_seconds()  # imports, weights and any mailbox in place
    if args.load:
        from jax_kimik3 import export

        with open(args.load, "rb") as f:
            # Under jit, calls take JAX's compiled fast path, not the primitive's dispatch.
            step = jax.jit(export.load(f.read()).call)
    else:
        step = make_step(mesh, params, args.layers, args.backend,
                         None if mailbox is None else mailbox.spec, args.stats_ahead,
                         args.virtual_tp, **tail)
    out, _ = step(params, embeddings[0], blocks, table)  # compile and warm up
    out.block_until_ready()
    source = ("exported step" if args.load else f"kernels, {KERNELS_ENV}={kernel_mode()}"
              if kernels else "reference")
    done = process_seconds()
    setup = "imports, weights" + ("" if mailbox is None else ", mailbox")
    print(f"startup ({source}): process start to first decode step done: {done:.1f} s "
          f"({setup} {ready:.1f} s; compile and first step {done - ready:.1f} s)")
    times, outs = [], []
    for s in range(1, args.steps + 1):
        start = time.perf_counter()
        out, _ = step(params, embeddings[s], blocks, table)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
        outs.append(out)
        if mailbox is not None and args.check_every and s % args.check_every == 0:
            report_mailbox(mailbox, s)
    checksum = sum(local_sum(out) for out in outs)
    path = ("exported kernels" if args.load else "kernels") if kernels else "reference"
    ranks = f"TP {args.virtual_tp} (virtual)" if args.virtual_tp else f"TP {tp}"
    if args.dp > 1:
        ranks = f"DP {args.dp} x {ranks}"
    if jax.process_count() > 1:
        ranks += f", process {jax.process_index()} of {jax.process_count()}"
    print(f"decode step: {args.layers} layers, batch {args.batch}, {ranks} on "
          f"{jax.devices()[0].platform} ({path}): median {1e3 * np.median(times):.2f} ms over "
          f"{args.steps} steps")
    print(f"checksum {checksum:.6e} (this process's rows)")
    if mailbox is not None:
        report_mailbox(mailbox, args.steps)
        if args.check:
            reference = make_step(mesh, params, args.layers, "reference", None,
                                  virtual_tp=args.virtual_tp)
            rels = []
            for s, out in enumerate(outs, 1):  # every timed step: a race shows in any of them
                want, _ = reference(params, embeddings[s], blocks, None)
                got, want = (np.concatenate([np.asarray(s.data, np.float32)
                                             for s in a.addressable_shards]) for a in (out, want))
                rels.append(relative_error(got, want))
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
    elif args.check:
        print("check: nothing to compare, the step runs the reference here (--check compares "
              "a kernel step with it)")


if __name__ == "__main__":
    main()
