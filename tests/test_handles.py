"""CPU: the exchange of shareable handles (jax_kimik3/handles.py): the choice of handle kind,
argument checks, the protocol against a faulty peer (threads over an in-memory store), and
real processes joined by jax.distributed (tests/handles_peer.py) exchanging memfds and bytes,
and timing out on a peer that never comes."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jax_kimik3 import handles
from jax_kimik3.handles import FABRIC, KINDS, POSIX_FD, ProcessGroup, choose_kind
from jax_kimik3.store import Abandoned, Store

PEER = Path(__file__).with_name("handles_peer.py")
PROCESS_TIMEOUT_S = 120  # a whole multi-process case: only a hang reaches it
HOST_A = "gpu-a/11111111-aaaa/net:[4026531840]"
HOST_A_OTHER_NET = "gpu-a/11111111-aaaa/net:[4026532000]"
HOST_B = "gpu-b/22222222-bbbb/net:[4026531840]"
HOST_B_SAME_NAME = "gpu-a/22222222-bbbb/net:[4026531840]"
BOTH = frozenset(KINDS)


# choose_kind

def test_one_host_posix_fd():
    assert choose_kind({0: HOST_A, 1: HOST_A}, {0: BOTH, 1: {POSIX_FD}}) == POSIX_FD


def test_one_host_fabric_without_posix_fd():
    assert choose_kind({0: HOST_A, 1: HOST_A}, {0: BOTH, 1: {FABRIC}}) == FABRIC


def test_one_host_without_a_common_kind():
    with pytest.raises(RuntimeError, match=r"processes \[0, 1, 2\] share one host \(gpu-a\).*"
                       r"POSIX fd handles are unsupported on process\(es\) \[1, 2\].*"
                       r"POSIX_FILE_DESCRIPTOR_SUPPORTED = 0.*fabric handles on process\(es\) "
                       r"\[0, 2\].*FABRIC_SUPPORTED = 0"):
        choose_kind({0: HOST_A, 1: HOST_A, 2: HOST_A},
                    {0: {POSIX_FD}, 1: {FABRIC}, 2: set()})


def test_hosts_fabric():
    assert choose_kind({0: HOST_A, 1: HOST_B}, {0: BOTH, 1: {FABRIC}}) == FABRIC


def test_hosts_without_fabric():
    with pytest.raises(RuntimeError, match=r"spans 2 hosts \(processes 0, 1 on gpu-a; 2 on "
                       r"gpu-b\).*fabric handles.*unsupported on process\(es\) \[1, 2\] "
                       r"\(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0\): a TP group "
                       r"must then stay within one host"):
        choose_kind({0: HOST_A, 1: HOST_A, 2: HOST_B}, {0: BOTH, 1: {POSIX_FD}, 2: {POSIX_FD}})


def test_network_namespaces_are_hosts():
    """An abstract Unix socket does not reach another network namespace of the same boot."""
    assert choose_kind({0: HOST_A, 1: HOST_A_OTHER_NET}, {0: BOTH, 1: BOTH}) == FABRIC
    with pytest.raises(RuntimeError, match=r"spans 2 hosts \(processes 0 on gpu-a \(11111111-"
                       r"aaaa/net:\[4026531840\]\); 1 on gpu-a \(11111111-aaaa/net:\[4026532000"):
        choose_kind({0: HOST_A, 1: HOST_A_OTHER_NET}, {0: {POSIX_FD}, 1: BOTH})


def test_hostnames_only_label():
    """Two machines of one hostname are two hosts (their boot ids differ)."""
    with pytest.raises(RuntimeError, match=r"spans 2 hosts.*22222222-bbbb"):
        choose_kind({0: HOST_A, 1: HOST_B_SAME_NAME}, {0: BOTH, 1: {POSIX_FD}})


@pytest.mark.parametrize("hosts, supported, error, match", [
    ({0: HOST_A}, {1: BOTH}, ValueError, r"processes \[0\].*processes \[1\].*same processes"),
    ({}, {}, ValueError, "at least one"),
    ({0: "gpu-a"}, {0: BOTH}, ValueError, r"hosts\[0\]='gpu-a' is not a host_identity"),
    ({0: HOST_A}, {0: {"cuda_ipc"}}, ValueError, r"supported\[0\].*unknown kinds \['cuda_ipc'\]"),
    ({0: HOST_A}, {0: POSIX_FD}, TypeError, r"supported\[0\]='posix_fd' must be a collection"),
])
def test_choose_kind_arguments(hosts, supported, error, match):
    with pytest.raises(error, match=match):
        choose_kind(hosts, supported)


def test_host_identity():
    hostname, boot, net = handles.host_identity().split("/")
    assert hostname == socket.gethostname()
    assert boot == Path(handles.BOOT_ID).read_text().strip()
    assert net == os.readlink(handles.NET_NAMESPACE) and net.startswith("net:[")


# arguments

def test_store_needs_distributed():
    from jax._src import distributed

    assert distributed.global_state.client is None  # the test process never initializes it
    with pytest.raises(RuntimeError, match=r"call jax\.distributed\.initialize"):
        Store()
    with pytest.raises(ValueError, match="needs process_id"):
        Store(object())


def test_group_arguments():
    store = Store(object(), process_id=1)
    with pytest.raises(ValueError, match="name='a//b'"):
        ProcessGroup("a//b", 1, (0, 1), store=store)
    with pytest.raises(ValueError, match=r"processes\[1\]=-1 must be >= 0"):
        ProcessGroup("g", 1, (0, -1), store=store)
    with pytest.raises(ValueError, match=r"process 1 owns no rank of processes=\(0, 2\)"):
        ProcessGroup("g", 1, (0, 2), store=store)
    with pytest.raises(ValueError, match=r"process_id=0 differs from the store's process id \(1"):
        ProcessGroup("g", 0, (0, 1), store=store)
    with pytest.raises(ValueError, match=r"timeout_ms=0 must be a number in \[0.001, 600000\]"):
        ProcessGroup("g", 1, (0, 1), store=store, timeout_ms=0)
    group = ProcessGroup("g", 1, (0, 1, 1, 2), store=store)
    assert group.ranks(1) == (1, 2) and group.owns(2) and not group.owns(3)
    assert group.members == (0, 1, 2) and group.peers == (0, 2)


def test_share_arguments():
    group = ProcessGroup("g", 1, (0, 1, 1), store=Store(object(), process_id=1))
    handle = bytes(handles.FABRIC_HANDLE_BYTES)
    with pytest.raises(ValueError, match=r"own has ranks \[1\]; process 1 owns ranks \[1, 2\]"):
        handles.share(group, {1: 3}, POSIX_FD)
    with pytest.raises(ValueError, match="kind='cuda_ipc' must be one of"):
        handles.share(group, {1: 3, 2: 4}, "cuda_ipc")
    with pytest.raises(ValueError, match=r"own\[2\]=True must be an integer"):
        handles.share(group, {1: 3, 2: True}, POSIX_FD)
    with pytest.raises(ValueError, match=r"own\[2\]=b'\\x00' must be a fabric handle: 64 bytes"):
        handles.share(group, {1: handle, 2: b"\0"}, FABRIC)
    alone = ProcessGroup("g", 1, (1, 1), store=Store(object(), process_id=1))
    assert handles.share(alone, {0: 3, 1: 4}, POSIX_FD) == {}  # no peer: no store, no socket


def test_barrier_arguments():
    with pytest.raises(ValueError, match=r"processes=\[0, 2\] must include this process, 1"):
        Store(object(), process_id=1).barrier("b", [0, 2], 1000)


# the protocol in threads, over an in-memory store

class MemoryClient:
    """The parts of jax.distributed's client that Store uses, in memory, for threads."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.changed:
            if key in self.values:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]

    def key_value_dir_get_bytes(self, key):
        with self.changed:
            return [(k, v) for k, v in self.values.items() if k.startswith(key + "/")]

    def key_value_delete(self, key):
        with self.changed:
            for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
                del self.values[k]


def collectively(*calls):
    """Run each call in its own thread; what each returned or raised."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 (the test checks it)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def groups(processes, timeout_ms=10_000, name="g"):
    """One ProcessGroup per process of `processes`, all over one MemoryClient."""
    client = MemoryClient()
    return client, [ProcessGroup(name, p, processes, store=Store(client, process_id=p),
                                 timeout_ms=timeout_ms) for p in sorted(set(processes))]


def memfds(label):
    """The fds of this process that are memfds named `label`."""
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            links[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the fd of the listing itself
            pass
    return sorted(fd for fd, link in links.items() if link.startswith(f"/memfd:{label} "))


def test_threads_exchange_and_leave_no_key():
    client, (g0, g1) = groups((0, 1, 1))
    fds = {r: os.memfd_create("threads") for r in range(3)}
    for r, fd in fds.items():
        os.write(fd, b"rank %d" % r)
    received = collectively(lambda: handles.share(g0, {0: fds[0]}, POSIX_FD),
                            lambda: handles.share(g1, {1: fds[1], 2: fds[2]}, POSIX_FD))
    assert sorted(received[0]) == [1, 2] and sorted(received[1]) == [0]
    for got in received:
        for r, fd in got.items():
            assert fd not in fds.values() and os.pread(fd, 10, 0) == b"rank %d" % r
            os.close(fd)
    for fd in fds.values():
        os.close(fd)
    kinds = collectively(lambda: handles.agree_kind(g0, BOTH, 4096),
                         lambda: handles.agree_kind(g1, {POSIX_FD}, 4096))
    assert kinds == [POSIX_FD, POSIX_FD]
    assert collectively(lambda: handles.barrier(g0, "x"), lambda: handles.barrier(g1, "x")) == [
        None, None]
    assert client.values == {}


def test_threads_buffer_sizes_differ():
    _, (g0, g1) = groups((0, 1))
    errors = collectively(lambda: handles.agree_kind(g0, BOTH, 4096),
                          lambda: handles.agree_kind(g1, BOTH, 8192))
    for e in errors:
        assert isinstance(e, RuntimeError)
        assert "bytes per rank = {0: 4096, 1: 8192}" in str(e)


def test_threads_peer_sends_wrong_ranks():
    """A peer whose message names ranks it does not own is refused, and the fds that came
    with it are closed."""
    client, (g0, _) = groups((0, 1), timeout_ms=5_000)
    store1 = Store(client, process_id=1)
    mine = os.memfd_create("mine")
    theirs = os.memfd_create("theirs")

    def faulty_peer():
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(b"\0jax_kimik3-test/faulty/%d" % os.getpid())
            listener.listen(1)
            store1.set("g/0/posix_fd/1", listener.getsockname())
            address = store1.get("g/0/posix_fd/0", 5_000, writer=0)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
                connection.connect(address)
                socket.send_fds(connection, [json.dumps({"sender": 1, "ranks": [5]}).encode()],
                                [theirs])
            connection, _ = listener.accept()
            with connection:  # take process 0's message before closing: else its send may
                _, fds, _, _ = socket.recv_fds(connection, 1024, 4)  # fail on a closed pipe
            for fd in fds:
                os.close(fd)

    error, _ = collectively(lambda: handles.share(g0, {0: mine}, POSIX_FD), faulty_peer)
    assert isinstance(error, RuntimeError)
    assert "process 1 sent ranks [5] with 1 fds; it owns ranks [1]" in str(error)
    assert memfds("theirs") == [theirs]  # the received duplicate is closed
    os.close(mine)
    os.close(theirs)


def test_threads_fabric_handles_of_wrong_size():
    client, (g0, _) = groups((0, 1), timeout_ms=5_000)
    store1 = Store(client, process_id=1)

    def faulty_peer():
        store1.set("g/0/fabric/1", b"short")
        store1.barrier("g/0/fabric/read", [0, 1], 5_000)

    error, _ = collectively(
        lambda: handles.share(g0, {0: bytes(handles.FABRIC_HANDLE_BYTES)}, FABRIC), faulty_peer)
    assert isinstance(error, RuntimeError)
    assert "process 1 sent 5 bytes of fabric handles for its 1 ranks (64 bytes each)" in str(error)


@pytest.mark.parametrize("collective", ["fds", "fabric", "barrier"])
def test_threads_a_process_that_gives_up_stops_the_others(collective):
    """A process that gives up (handles.abandon, e.g. its allocation failed) stops its peers'
    waits at once with its reason, not after the group's 60 s timeout; the group then refuses
    later collectives on both sides."""
    _, (g0, g1) = groups((0, 1), timeout_ms=60_000)
    fd = os.memfd_create("waiting")
    wait = {"fds": lambda: handles.share(g0, {0: fd}, POSIX_FD),
            "fabric": lambda: handles.share(g0, {0: bytes(handles.FABRIC_HANDLE_BYTES)}, FABRIC),
            "barrier": lambda: handles.barrier(g0, "arm")}[collective]

    def give_up():
        time.sleep(0.3)  # process 0 is waiting by now
        handles.abandon(g1, "making the mailbox: RuntimeError: cuMemCreate failed")

    start = time.monotonic()
    error, _ = collectively(wait, give_up)
    os.close(fd)
    assert isinstance(error, Abandoned), error
    assert "process 1: making the mailbox: RuntimeError: cuMemCreate failed" in str(error)
    assert time.monotonic() - start < 10  # the watch, not the 60 s timeout
    for group in (g0, g1):
        with pytest.raises(RuntimeError, match=r"failed in an earlier collective"):
            handles.barrier(group, "again")


def test_threads_barrier_of_a_subset():
    """A barrier of processes 0 and 2 passes without process 1; a late member times out with
    the names of the processes that never arrived."""
    _, stores = groups((0, 1, 2))
    stores = [g.store for g in stores]
    late = threading.Event()

    def first():
        stores[0].barrier("b", [0, 2], 5_000)
        return late.is_set()

    def second():
        time.sleep(0.2)  # process 0 is in the barrier by now, and stays until this arrives
        late.set()
        stores[2].barrier("b", [2, 0], 5_000)

    assert collectively(first, second) == [True, None]
    e = collectively(lambda: stores[1].barrier("c", [0, 1, 2], 300))[0]
    assert isinstance(e, TimeoutError)
    assert "process(es) [0, 2] never arrived within 300 ms" in str(e)


# real processes, joined by jax.distributed

def run_processes(scenario, count):
    """tests/handles_peer.py as processes 0..count-1 of one jax.distributed runtime: each
    process's RESULT (a failing or hanging process fails the test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # conftest's eight host devices: not needed here
    procs = [subprocess.Popen([sys.executable, str(PEER), str(port), str(count), str(i),
                               scenario], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(count)]
    try:
        outputs = [p.communicate(timeout=PROCESS_TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate() for p in procs]
        pytest.fail(f"{scenario}: a process hung; stderr tails: "
                    f"{[err[-2000:] for _, err in outputs]}")
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and len(lines) == 1, f"process {i}: {out}\n{err[-4000:]}"
        results.append(json.loads(lines[0].removeprefix("RESULT ")))
    return results


@pytest.fixture(scope="module")
def exchanged():
    return run_processes("exchange", 3)


@pytest.fixture(scope="module")
def abandoned():
    return run_processes("absent", 2)[0]


def test_processes_agree_on_posix_fd(exchanged):
    assert [r["kind"] for r in exchanged] == [POSIX_FD] * 3
    assert [r["owns"] for r in exchanged] == [[0, 1], [2, 3], [4]]


def test_processes_share_fds(exchanged):
    from tests.handles_peer import OWNERS, content

    for me, result in enumerate(exchanged):
        others = [r for r, p in enumerate(OWNERS) if p != me]
        assert result["fds"] == {str(r): content(r).decode() for r in others}
        assert result["cloexec"]


def test_processes_share_fabric_handles(exchanged):
    from tests.handles_peer import OWNERS

    for me, result in enumerate(exchanged):
        assert result["fabric"] == {str(r): True for r, p in enumerate(OWNERS) if p != me}


def test_processes_barrier_of_a_subset(exchanged):
    assert exchanged[0]["subset_saw_2"]


def test_processes_leave_no_key(exchanged):
    assert exchanged[0]["left"] == []


@pytest.mark.parametrize("case, error, match", [
    ("posix_fd", "TimeoutError",
     r"group 'never': process\(es\) \[1\] never published their socket within 1000 ms"),
    ("accept", "TimeoutError",
     r"group 'late': process\(es\) \[1\] never sent their fds within 1000 ms"),
    ("gone", "RuntimeError", r"group 'gone': cannot send fds to process 1 .*Connection refused"),
    ("fabric", "TimeoutError",
     r"group 'never-f': process\(es\) \[1\] never published theirs within 1000 ms"),
    ("barrier", "TimeoutError", (r"barrier 'jax_kimik3/never-b/0/arm' of processes \[0, 1\]: "
                                 r"process\(es\) \[1\] never arrived within 1000 ms")),
])
def test_processes_absent_peer(abandoned, case, error, match):
    assert abandoned["errors"][case][0] == error
    assert re.search(match, abandoned["errors"][case][1]), abandoned["errors"][case][1]


def test_processes_absent_peer_leaves_no_socket(abandoned):
    assert abandoned["sockets_left"] == []
