"""One process of tests/test_handles.py's multi-process cases (jax.distributed on CPU).

Usage: python tests/handles_peer.py PORT PROCESSES PROCESS_ID SCENARIO. It joins the runtime at
127.0.0.1:PORT, runs SCENARIO ("exchange" with three processes, "absent" with two) and prints
one line RESULT <json> for the test to check; a failure is a traceback and a nonzero exit.
"""

import fcntl
import json
import os
import socket
import sys
import time

import jax

from jax_kimik3 import handles
from jax_kimik3.store import Store

OWNERS = (0, 0, 1, 1, 2)  # "exchange": the process of each rank (five ranks, three processes)
TIMEOUT_MS = 60_000  # for steps that succeed: only a hang reaches it
SHORT_MS = 1_000  # for steps whose peer never comes


def content(rank):
    """What rank `rank`'s memory holds in these tests."""
    return f"the buffer of rank {rank}".encode()


def fabric_handle(rank):
    """A fake fabric handle of rank `rank`: FABRIC_HANDLE_BYTES distinct bytes."""
    return bytes((rank * 37 + i) % 256 for i in range(handles.FABRIC_HANDLE_BYTES))


def memfd(rank):
    """An fd of anonymous memory holding content(rank)."""
    fd = os.memfd_create(f"rank{rank}")
    os.write(fd, content(rank))
    return fd


def exchange(me):
    """agree_kind, share of both kinds, a barrier of a subset, the group's keys gone after."""
    store = Store()
    group = handles.ProcessGroup("mailbox0", me, OWNERS, timeout_ms=TIMEOUT_MS)
    result = {"kind": handles.agree_kind(group, handles.KINDS, 4096), "owns": [
        r for r in range(len(OWNERS)) if group.owns(r)]}
    own = {r: memfd(r) for r in group.ranks(me)}
    received = handles.share(group, own, handles.POSIX_FD)
    for fd in own.values():
        os.close(fd)
    result["fds"] = {r: os.pread(fd, 100, 0).decode() for r, fd in received.items()}
    result["cloexec"] = all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                            for fd in received.values())
    for fd in received.values():
        os.close(fd)
    received = handles.share(group, {r: fabric_handle(r) for r in group.ranks(me)},
                             handles.FABRIC)
    result["fabric"] = {r: h == fabric_handle(r) for r, h in received.items()}
    if me == 1:  # not in the subset: waits until process 0 has passed the subset's barrier
        store.get("test/after-subset", TIMEOUT_MS, writer=0)
    else:
        if me == 2:  # late, and seen by process 0 after the barrier: the barrier waited for it
            time.sleep(0.5)
            store.set("test/before-subset/2", b"")
        store.barrier("subset", [0, 2], TIMEOUT_MS)
        if me == 0:
            result["subset_saw_2"] = "2" in store.listing("test/before-subset")
            store.set("test/after-subset", b"")
    handles.barrier(group, "end")
    if me == 0:  # the leader of every barrier: after "end" no key of the group is left
        result["left"] = sorted(store.listing("mailbox0")) + sorted(store.listing("subset"))
    return result


def absent(me):
    """Process 0's collectives whose peer, process 1, never takes part: TimeoutErrors."""
    store = Store()
    if me == 1:  # a socket that never sends, one that is gone, then wait for the end; each
        # published where process 0's first step (0) of groups "late" and "gone" looks for it
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
            silent.bind(b"\0jax_kimik3-test/silent/%d" % os.getpid())
            silent.listen(1)
            store.set("late/0/posix_fd/1", silent.getsockname())
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as gone:
                gone.bind(b"\0jax_kimik3-test/gone/%d" % os.getpid())
                store.set("gone/0/posix_fd/1", gone.getsockname())
            store.set("test/ready", b"")
            store.get("test/done", TIMEOUT_MS, writer=0)
        return {}
    store.get("test/ready", TIMEOUT_MS, writer=1)
    errors = {}
    cases = {"posix_fd": ("never", handles.POSIX_FD), "accept": ("late", handles.POSIX_FD),
             "gone": ("gone", handles.POSIX_FD), "fabric": ("never-f", handles.FABRIC)}
    for case, (name, kind) in cases.items():
        group = handles.ProcessGroup(name, 0, (0, 1), timeout_ms=SHORT_MS)
        own = {0: memfd(0) if kind == handles.POSIX_FD else fabric_handle(0)}
        try:
            handles.share(group, own, kind)
        except (TimeoutError, RuntimeError) as e:
            errors[case] = [type(e).__name__, str(e)]
        if kind == handles.POSIX_FD:
            os.close(own[0])
    group = handles.ProcessGroup("never-b", 0, (0, 1), timeout_ms=SHORT_MS)
    try:
        handles.barrier(group, "arm")
    except TimeoutError as e:
        errors["barrier"] = [type(e).__name__, str(e)]
    store.set("test/done", b"")
    with open("/proc/net/unix") as f:  # the exchanges' listeners are closed
        mine = [line.split()[-1] for line in f if f"@jax_kimik3/{os.getpid()}/" in line]
    return {"errors": errors, "sockets_left": mine}


def main():
    port, processes, me, scenario = sys.argv[1:]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(processes),
                               process_id=int(me))
    result = {"exchange": exchange, "absent": absent}[scenario](int(me))
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()  # waits until every process shuts down


if __name__ == "__main__":
    main()
