"""One process of a multi-process mailbox run, started by tests/test_gpu_processes.py (several
processes, all on one GPU or one per GPU, joined by jax.distributed). Prints one JSON line:
what it checked on its devices and a digest of every result, so the test can hold the ranks
of a group to bit-identical results across processes.

Scenarios:
- "mesh": a MeshMailbox over a ("tp",) or ("dp", "tp") mesh of every process's devices; the
  all-reduce and the post-attention tail, twice each (both buffers), every device's result
  against the float64 model (tests/oracle.py), computed here: XLA has no collective across
  processes that share a GPU, so the reference path (psum) cannot run.
- "killed": two ranks; after one good all-reduce the last process kills itself (SIGKILL) and
  the others' next all-reduce must come back as NaN rows with a reported timeout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax_kimik3 as k3  # noqa: E402
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs  # noqa: E402
from tests import oracle  # noqa: E402

H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks
BATCH, NUM_BLOCKS = 4, 5


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()[:16]


def per_device(mesh, global_value):
    """A jax.Array of `global_value` (leading axes: the mesh's), one block per device."""
    spec = NamedSharding(mesh, P(*mesh.axis_names))
    return jax.make_array_from_callback(global_value.shape, spec,
                                        lambda index: global_value[index])


def key(call, idx):
    """A result's name in the report: "call/g.r" (mesh position (g, r)) or "call/r"."""
    return f"{call}/" + ".".join(map(str, idx))


def positions(mesh):
    return {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}


def reduce_step(mesh, mailbox):
    """partials (mesh shape + [B, H]) → each device's all-reduced rows, same shape."""
    lead = (1,) * mesh.devices.ndim

    def reduce(p, table):
        out = k3.all_reduce(p.reshape(p.shape[-2:]), mailbox, axis_name="tp", peer_table=table)
        return out.reshape(lead + out.shape)

    return jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=(P(*mesh.axis_names),) * 2,
                                 out_specs=P(*mesh.axis_names)))


def run_all_reduce(mesh, mailbox, rng, report):
    step = reduce_step(mesh, mailbox)
    where = positions(mesh)
    for call in range(2):  # the mailbox's two buffers in turn
        partials = oracle.to_bf16(rng.standard_normal((*mesh.devices.shape, BATCH, H)))
        got = step(per_device(mesh, partials), mailbox.table)
        for shard in got.addressable_shards:
            idx = where[shard.device.id]
            group = partials[idx[:-1]] if mesh.devices.ndim > 1 else partials
            rows = np.asarray(shard.data).reshape(BATCH, H)
            np.testing.assert_array_equal(rows.view(np.uint16),
                                          oracle.rank_order_sum(list(group)).view(np.uint16))
            oracle.assert_bf16_close(rows, sum(oracle.f64(p) for p in group),
                                     f"all-reduce on device {idx}")
            report.setdefault("all_reduce", {})[key(call, idx)] = digest(rows)


def tail_step(mesh, mailbox):
    axes = mesh.axis_names
    rows = P("dp") if "dp" in axes else P()
    lead = (1,) * len(axes)

    def tail(x, w, prefix, blocks, g, proj, out_w, table):
        out, new_prefix, _ = k3.oproj_attn_res(
            x, w, prefix, blocks, g, proj, out_w, axis_name="tp", num_blocks=NUM_BLOCKS,
            has_delta=True, mailbox=mailbox, peer_table=table, backend="kernel")
        return out.reshape(lead + out.shape), new_prefix.reshape(lead + new_prefix.shape)

    x_spec = P("dp", "tp") if "dp" in axes else P(None, "tp")
    return jax.jit(jax.shard_map(
        tail, mesh=mesh, in_specs=(x_spec, P(None, "tp"), rows, rows, P(), P(), P(), P(*axes)),
        out_specs=(P(*axes), P(*axes))))


def run_tail(mesh, mailbox, rng, report):
    """The post-attention tail of every group (its own rows, one o_proj weight)."""
    dp = mesh.shape.get("dp", 1)
    step = tail_step(mesh, mailbox)
    where = positions(mesh)
    put = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
        a.shape, NamedSharding(mesh, spec), lambda index: a[index])
    rows = P("dp") if dp > 1 else P()
    for call in range(2):
        inps = [attn_res_inputs(rng, BATCH, NB) for _ in range(dp)]
        xs, w = zip(*[oproj_inputs(rng, BATCH) for _ in range(dp)])
        w = w[0]
        cat = lambda name: np.concatenate([getattr(i, name) for i in inps])  # noqa: E731
        args = (put(np.concatenate(xs), P("dp", "tp") if dp > 1 else P(None, "tp")),
                put(w, P(None, "tp")), put(cat("prefix"), rows), put(cat("blocks"), rows),
                put(inps[0].res_norm_w, P()), put(inps[0].res_proj_w, P()),
                put(inps[0].out_norm_w, P()))
        weights = dict(res_norm_w=inps[0].res_norm_w, res_proj_w=inps[0].res_proj_w,
                       out_norm_w=inps[0].out_norm_w)
        out, prefix = step(*args, mailbox.table)
        for o, p in zip(out.addressable_shards, prefix.addressable_shards):
            idx = where[o.device.id]
            g = idx[0] if dp > 1 else 0
            inp = inps[g]._replace(**weights)
            got_out = np.asarray(o.data).reshape(BATCH, H)
            got_prefix = np.asarray(p.data).reshape(BATCH, H)
            oracle.assert_tail_close(got_out, got_prefix, xs[g], w, inp, tp=mesh.shape["tp"],
                                     num_blocks=NUM_BLOCKS, has_delta=True)
            report.setdefault("tail", {})[key(call, idx)] = digest(got_out) + digest(got_prefix)


def live_mailbox_refused(mesh, mailbox) -> bool:
    """A group's live Mailbox (its table a constant of this process's addresses) is refused
    under several processes, at trace time, with what to use instead."""
    group = next(iter(mailbox.mailboxes.values()))
    f = jax.shard_map(lambda rows: k3.all_reduce(rows, group, axis_name="tp"), mesh=mesh,
                      in_specs=P(*mesh.axis_names), out_specs=P(*mesh.axis_names))
    try:
        jax.jit(f).trace(jax.ShapeDtypeStruct((mesh.size * BATCH, H), jnp.bfloat16))
    except ValueError as e:
        return "use a MeshMailbox" in str(e)
    return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--scenario", choices=("mesh", "killed"), default="mesh")
    parser.add_argument("--timeout-ms", type=float, default=20_000.0)
    args = parser.parse_args()
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id)
    devices = np.array(jax.devices())
    mesh = (Mesh(devices.reshape(args.dp, -1), ("dp", "tp")) if args.dp > 1
            else Mesh(devices, ("tp",)))
    report = dict(process=jax.process_index(), mesh=dict(mesh.shape),
                  devices=len(jax.local_devices()))
    rng = np.random.default_rng(7)  # the same draws in every process
    mailbox = k3.MeshMailbox(mesh, "tp", timeout_ms=args.timeout_ms)
    report["groups"] = sorted(mailbox.mailboxes)
    if args.scenario == "mesh":
        report["live_mailbox_refused"] = live_mailbox_refused(mesh, mailbox)
        run_all_reduce(mesh, mailbox, rng, report)
        run_tail(mesh, mailbox, rng, report)
        mailbox.check()
        report["calls"] = {str(g): c for g, c in mailbox.calls().items()}
        report["unarmed"] = sum(m.unarmed() for m in mailbox.mailboxes.values())
        mailbox.arm()  # collective: every process re-arms together
        report["calls_after_arm"] = {str(g): c for g, c in mailbox.calls().items()}
        mailbox.close()
        print(json.dumps(report), flush=True)
        jax.distributed.shutdown()
        return
    # "killed": one good call, then the last process dies before the second.
    step = reduce_step(mesh, mailbox)
    partials = oracle.to_bf16(rng.standard_normal((*mesh.devices.shape, BATCH, H)))
    first = step(per_device(mesh, partials), mailbox.table)
    first.block_until_ready()
    mailbox.check()
    report["first_ok"] = all(
        np.array_equal(np.asarray(s.data).reshape(BATCH, H).view(np.uint16),
                       oracle.rank_order_sum(list(partials)).view(np.uint16))
        for s in first.addressable_shards)
    if jax.process_index() == jax.process_count() - 1:
        print(json.dumps(dict(report, killed=True)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    second = np.asarray(step(per_device(mesh, partials), mailbox.table).addressable_shards[0]
                        .data)
    report["second_all_nan"] = bool(np.isnan(second.astype(np.float32)).all())
    try:
        mailbox.check()
        report["timeout"] = None
    except TimeoutError as e:
        report["timeout"] = str(e)
    mailbox.close()
    print(json.dumps(report), flush=True)
    os._exit(0)  # the coordination service would wait for the killed process at shutdown


if __name__ == "__main__":
    main()
