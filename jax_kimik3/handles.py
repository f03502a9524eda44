"""Moving shareable handles of mailbox memory between the processes of a TP group.

A TP group may span processes (one per GPU, started with jax.distributed.initialize). Each
process allocates its own ranks' buffers with an exportable handle type (jax_kimik3/mailbox.py
exports and imports them through the CUDA driver); this module carries the handles to the
group's other processes. Two kinds of handles exist:

- POSIX_FD: a file descriptor (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), for the processes of
  one host. An fd means something only inside its process, so it travels through a Unix
  domain socket (SCM_RIGHTS), which the kernel duplicates into the receiver.
- FABRIC: a CUmemFabricHandle (CU_MEM_HANDLE_TYPE_FABRIC), FABRIC_HANDLE_BYTES opaque bytes that
  name the memory across the hosts of a multi-node NVLink fabric (GB200/GB300 NVL72), where the
  driver offers them. Plain bytes travel through the key-value store itself.

The rendezvous is the key-value store of jax.distributed, which the processes already share
(`jax_kimik3.store.Store`); nothing else is launched or listened on beyond the Unix sockets of one exchange.
A `ProcessGroup` names which process owns which rank; its collectives (`agree_kind`, `share`,
`barrier`) are called by every process of the group, in the same order. Each takes the next
step number of the group, so its keys are NAMESPACE/<group name>/<step>/<label>/...

Protocol of `share` with POSIX_FD (no threads):
1. Bind a SOCK_SEQPACKET Unix socket at a unique abstract address (reachable within the
   host's network namespace only), listen with a backlog of one connection per peer process,
   and publish the address under the step's key of this process.
2. Read every peer's address (blocking on the store until the deadline).
3. For each peer (in order of process id): connect, send one message whose data is a JSON
   header {"sender": process id, "ranks": its ranks} and whose SCM_RIGHTS are the fds of those
   ranks, close. A connection waits in the peer's backlog until accepted, so connecting never
   waits for the peer to reach step 4: no order of arrival deadlocks.
4. Accept one connection per peer, receive its message, check the header against the group
   (the sender is a peer not yet heard from, its ranks are the group's ranks of that sender,
   one fd per rank), and keep the fds, duplicated into this process.
5. Close the listener and delete this process's address: every peer connected, so every
   peer has read it.

Protocol of `share` with FABRIC and of `agree_kind`, an all-gather of one value per process
(FABRIC: its ranks' handles, concatenated in rank order; agree_kind: its host_identity(),
supported kinds and buffer size, from which every process then makes the same choose_kind):
1. Each process publishes its value.
2. It reads every peer's value (blocking on the store until the deadline).
3. A barrier among the group's processes: after it nobody reads the values any more.
4. Each process deletes its own value.

Constraints: every collective gives up after the group's timeout_ms in all, with a TimeoutError
that names the processes that never did their part (a failed exchange may leave its keys in
the store). A process that gives up (`abandon`; a collective that fails does so itself) says
why under the group's `watch` keys, and every wait of the others' collectives stops at once
with that reason (store.Abandoned). A group's name is the same on every process and used by one group only
(MeshMailbox derives it from the mesh, the axis and how many mailboxes of that mesh came
before, which every process agrees on because creation is collective). Received fds are this process's, close-on-exec; the caller
closes them. At most MAX_FDS ranks per process (the kernel's SCM_MAX_FD per message). Linux only
(abstract Unix sockets, /proc).
"""

from __future__ import annotations

import array
import functools
import itertools
import json
import os
import socket
import uuid

from jax_kimik3.config import check_int
from jax_kimik3.layout import check_timeout_ms
from jax_kimik3.store import NAMESPACE, WATCH_MS, Deadline, Store

POSIX_FD = "posix_fd"  # handle kinds
FABRIC = "fabric"
KINDS = (POSIX_FD, FABRIC)
SUPPORT_ATTRIBUTES = {  # the device attribute that says a kind is supported
    POSIX_FD: "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    FABRIC: "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"}
HANDLE_TYPES = {  # the CUmemAllocationHandleType of each kind
    POSIX_FD: "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    FABRIC: "CU_MEM_HANDLE_TYPE_FABRIC"}
FABRIC_HANDLE_BYTES = 64  # sizeof(CUmemFabricHandle)
MAX_FDS = 253  # Linux's SCM_MAX_FD: the most fds one message carries
MAX_HEADER_BYTES = 65536  # the receive buffer of a POSIX_FD message's header
EXCHANGE_TIMEOUT_MS = 300_000  # as long as jax.distributed.initialize waits for the processes
BOOT_ID = "/proc/sys/kernel/random/boot_id"
NET_NAMESPACE = "/proc/self/ns/net"
HOST_SEPARATOR = "/"  # between the parts of a host identity (none of them contains it)


class ProcessGroup:
    """The processes of one TP group and the store they meet in: rank r belongs to process
    processes[r]. `name`, the same on every process of the group and used by this group only,
    roots the group's keys; `timeout_ms` bounds each of its collectives."""

    def __init__(self, name: str, process_id: int, processes, *, store: Store | None = None,
                 timeout_ms: float = EXCHANGE_TIMEOUT_MS):
        if not isinstance(name, str) or not all(name.split("/")):
            raise ValueError(f"name={name!r} must be a non-empty str whose '/'-separated "
                             "parts are non-empty")
        processes = tuple(processes)
        if not processes:
            raise ValueError("processes=() must name the process of each rank")
        for r, p in enumerate(processes):
            check_int(f"processes[{r}]", p, 0)
        store = Store() if store is None else store
        if store.process_id != process_id:
            raise ValueError(f"process_id={process_id!r} differs from the store's process id "
                             f"({store.process_id})")
        if process_id not in processes:
            raise ValueError(f"process {process_id} owns no rank of processes={processes}: "
                             "only a group's processes call its collectives")
        self.name, self.process_id, self.processes, self.store = (name, process_id, processes,
                                                                  store)
        self.timeout_ms = check_timeout_ms(timeout_ms)
        self.members = tuple(sorted(set(processes)))
        self.peers = tuple(p for p in self.members if p != process_id)
        self._steps = itertools.count()
        self.failed = None  # why a collective of the group failed: it is unusable since
        self.watch = f"{name}/abandoned"  # where its processes say that they gave up

    def __repr__(self):
        return (f"ProcessGroup(name={self.name!r}, process_id={self.process_id}, "
                f"processes={self.processes})")

    def owns(self, rank: int) -> bool:
        """Whether this process owns rank `rank`."""
        return self.processes[rank] == self.process_id

    def ranks(self, process: int) -> tuple[int, ...]:
        """The ranks of process `process`, in order."""
        return tuple(r for r, p in enumerate(self.processes) if p == process)

    def _step(self, label: str) -> str:
        """The key directory of the group's next collective."""
        if self.failed is not None:
            raise RuntimeError(f"group {self.name!r} failed in an earlier collective "
                               f"({self.failed}); its processes no longer agree on the next "
                               "one: make the mailbox anew")
        return f"{self.name}/{next(self._steps)}/{label}"


def _collective(function):
    """A collective of a group: once one fails, the group refuses every later one (a process
    that gave up and one that did not would number their next collectives apart)."""
    @functools.wraps(function)
    def collective(group, *args, **kwargs):
        try:
            return function(group, *args, **kwargs)
        except BaseException as e:
            abandon(group, f"{function.__name__}: {type(e).__name__}: {e}")
            raise
    return collective


def abandon(group: ProcessGroup, reason: str) -> None:
    """This process gives up on the group: its later collectives are refused, and the other
    processes' waits in the group's collectives stop at once with `reason` (store.Abandoned)
    instead of running out their timeout."""
    if group.failed is None:
        group.failed = reason
    try:
        group.store.abandon(group.watch, reason)
    except Exception:  # noqa: BLE001 (a store that is gone cannot be told; the peers time out)
        pass


def host_identity() -> str:
    """What makes two processes one host for POSIX fds: "hostname/boot id/network namespace".
    The boot id tells machines (and boots) apart; the network namespace is the reach of an
    abstract Unix socket. The hostname is only for messages."""
    with open(BOOT_ID) as f:
        boot = f.read().strip()
    return HOST_SEPARATOR.join((socket.gethostname(), boot, os.readlink(NET_NAMESPACE)))


def choose_kind(hosts: dict[int, str], supported: dict) -> str:
    """The handle kind a group's exchange uses. `hosts`: process id -> its host_identity();
    `supported`: process id -> the kinds its devices export. One host: POSIX_FD where every
    process supports it, else FABRIC where every process supports that; several hosts: FABRIC
    where every process supports it. Otherwise a RuntimeError says why no kind fits."""
    if not hosts or set(hosts) != set(supported):
        raise ValueError(f"hosts (processes {sorted(hosts)}) and supported (processes "
                         f"{sorted(supported)}) must name the same processes, at least one")
    machines = {}  # (boot id, network namespace) -> [(process, hostname)]
    for p in sorted(hosts):
        parts = hosts[p].split(HOST_SEPARATOR) if isinstance(hosts[p], str) else ()
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"hosts[{p}]={hosts[p]!r} is not a host_identity() "
                             "(hostname/boot id/network namespace)")
        machines.setdefault(tuple(parts[1:]), []).append((p, parts[0]))
    kinds = {p: _kinds(f"supported[{p}]", supported[p]) for p in hosts}
    lacking = {kind: [p for p in sorted(kinds) if kind not in kinds[p]] for kind in KINDS}
    if len(machines) == 1:
        if not lacking[POSIX_FD]:
            return POSIX_FD
        if not lacking[FABRIC]:
            return FABRIC
        raise RuntimeError(
            f"processes {sorted(hosts)} share one host ({_host_names(machines)[0]}), but POSIX "
            f"fd handles are unsupported on process(es) {lacking[POSIX_FD]} "
            f"({SUPPORT_ATTRIBUTES[POSIX_FD]} = 0) and fabric handles on process(es) "
            f"{lacking[FABRIC]} ({SUPPORT_ATTRIBUTES[FABRIC]} = 0)")
    if not lacking[FABRIC]:
        return FABRIC
    spread = "; ".join(f"{', '.join(str(p) for p, _ in processes)} on {host}" for processes, host
                       in zip(machines.values(), _host_names(machines)))
    raise RuntimeError(
        f"the group spans {len(machines)} hosts (processes {spread}), so its handles must be "
        f"fabric handles, which are unsupported on process(es) {lacking[FABRIC]} "
        f"({SUPPORT_ATTRIBUTES[FABRIC]} = 0): a TP group must then stay within one host")


@_collective
def agree_kind(group: ProcessGroup, supported, nbytes: int) -> str:
    """The handle kind of the group's exchange (collective): choose_kind over every process's
    host_identity() and `supported` kinds. Every process must allocate `nbytes` per rank (an
    importer maps a peer's buffer at its own size); a RuntimeError names the sizes otherwise."""
    supported = sorted(_kinds("supported", supported))
    check_int("nbytes", nbytes, 1)
    mine = json.dumps({"host": host_identity(), "kinds": supported, "nbytes": nbytes})
    facts = {p: json.loads(v) for p, v in
             _all_gather(group, "kind", mine.encode(), Deadline(group.timeout_ms)).items()}
    sizes = {p: f["nbytes"] for p, f in facts.items()}
    if len(set(sizes.values())) != 1:
        raise RuntimeError(f"group {group.name!r}: the processes' buffers differ in size "
                           f"(process: bytes per rank = {sizes}); every process must lay out "
                           "the same mailbox")
    return choose_kind({p: f["host"] for p, f in facts.items()},
                       {p: f["kinds"] for p, f in facts.items()})


@_collective
def share(group: ProcessGroup, own: dict, kind: str) -> dict:
    """Every other process's handles (collective): `own` maps each rank of this process to its
    handle (an fd for POSIX_FD, FABRIC_HANDLE_BYTES bytes for FABRIC); the result maps every
    rank of the group's other processes to theirs (fds received into this process, which the
    caller closes; or bytes)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    mine = group.ranks(group.process_id)
    if sorted(own) != list(mine):
        raise ValueError(f"own has ranks {sorted(own)}; process {group.process_id} owns ranks "
                         f"{list(mine)} of processes={group.processes}")
    for r, handle in own.items():
        if kind == POSIX_FD:
            check_int(f"own[{r}]", handle, 0)
        elif not isinstance(handle, bytes) or len(handle) != FABRIC_HANDLE_BYTES:
            raise ValueError(f"own[{r}]={handle!r} must be a fabric handle: "
                             f"{FABRIC_HANDLE_BYTES} bytes")
    if kind == POSIX_FD and len(own) > MAX_FDS:
        raise ValueError(f"process {group.process_id} owns {len(own)} ranks; with POSIX_FD one "
                         f"process may own at most {MAX_FDS} (one message's fds)")
    if not group.peers:
        return {}
    deadline = Deadline(group.timeout_ms)
    if kind == POSIX_FD:
        return _share_fds(group, own, deadline)
    values = _all_gather(group, FABRIC, b"".join(own[r] for r in mine), deadline)
    received = {}
    for p in group.peers:
        ranks = group.ranks(p)
        if len(values[p]) != FABRIC_HANDLE_BYTES * len(ranks):
            raise RuntimeError(f"group {group.name!r}: process {p} sent {len(values[p])} bytes "
                               f"of fabric handles for its {len(ranks)} ranks "
                               f"({FABRIC_HANDLE_BYTES} bytes each)")
        for i, r in enumerate(ranks):
            received[r] = values[p][i * FABRIC_HANDLE_BYTES:(i + 1) * FABRIC_HANDLE_BYTES]
    return received


@_collective
def barrier(group: ProcessGroup, label: str) -> None:
    """Wait until every process of the group has reached this barrier (collective; `label`
    names it in keys and messages)."""
    group.store.barrier_until(group._step(label), group.members, Deadline(group.timeout_ms),
                              group.watch)


def _all_gather(group, label, value, deadline) -> dict[int, bytes]:
    """Every process's `value` (this one's too; in order of process id), by the all-gather of
    the module docstring."""
    store, me = group.store, group.process_id
    step = group._step(label)
    store.set(f"{step}/{me}", value)
    values = store.gather(step, group.peers, deadline,
                          f"{label} exchange of group {group.name!r}", "never published theirs",
                          group.watch)
    store.barrier_until(f"{step}/read", group.members, deadline, group.watch)
    store.delete(f"{step}/{me}")
    return dict(sorted({**values, me: value}.items()))


def _share_fds(group, own, deadline) -> dict[int, int]:
    """The POSIX_FD exchange of the module docstring."""
    store, me = group.store, group.process_id
    step = group._step(POSIX_FD)
    what = f"fd exchange of group {group.name!r}"
    header = json.dumps({"sender": me, "ranks": sorted(own)}).encode()
    received, senders, arrived = {}, set(), []  # arrived: every fd received, closed on error
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            address = f"\0{NAMESPACE}/{os.getpid()}/{uuid.uuid4().hex}".encode()
            listener.bind(address)
            listener.listen(len(group.peers))
            store.set(f"{step}/{me}", address)
            addresses = store.gather(step, group.peers, deadline, what,
                                     "never published their socket", group.watch)
            for p in group.peers:
                _send_fds(addresses[p], header, [own[r] for r in sorted(own)], p, deadline,
                          what)
            while len(senders) < len(group.peers):
                store.check_watch(group.watch)
                listener.settimeout(min(deadline.left_s(), WATCH_MS / 1000))
                try:
                    connection, _ = listener.accept()
                except TimeoutError as e:
                    if deadline.left_ms() > 0:
                        continue
                    missing = [p for p in group.peers if p not in senders]
                    raise TimeoutError(f"{what}: process(es) {missing} never sent their fds "
                                       f"within {deadline.timeout_ms:g} ms (process {me} "
                                       "waited)") from e
                with connection:
                    connection.settimeout(deadline.left_s())
                    message, fds, flags = _receive_fds(connection, arrived)
                sender, ranks = _check_message(group, message, fds, flags, senders)
                received.update(zip(ranks, fds))
                senders.add(sender)
        store.delete(f"{step}/{me}")
    except BaseException:
        for fd in arrived:
            os.close(fd)
        raise
    return received


def _send_fds(address, header, fds, process, deadline, what):
    """Send `fds` with `header` to process `process`'s socket at `address`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(deadline.left_s())
        try:
            connection.connect(address)
            socket.send_fds(connection, [header], fds)
        except TimeoutError as e:
            raise TimeoutError(f"{what}: process {process} never took the fds within "
                               f"{deadline.timeout_ms:g} ms") from e
        except OSError as e:
            raise RuntimeError(
                f"{what}: cannot send fds to process {process} at socket {address!r} ({e}): "
                "it left the exchange, or it is on another host (host_identity) and the "
                "group needs FABRIC handles") from e


def _receive_fds(connection, arrived) -> tuple[bytes, list[int], int]:
    """One message from `connection`: its data, its fds (close-on-exec, also appended to
    `arrived`) and its flags. (socket.recv_fds of Python 3.11 drops its flags argument.)"""
    fds = array.array("i")
    message, ancillary, flags, _ = connection.recvmsg(
        MAX_HEADER_BYTES, socket.CMSG_LEN(MAX_FDS * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, type_, data in ancillary:
        if level == socket.SOL_SOCKET and type_ == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    arrived.extend(fds)
    return message, list(fds), flags


def _check_message(group, message, fds, flags, senders) -> tuple[int, tuple[int, ...]]:
    """The sender and ranks of a received POSIX_FD message, checked against the group."""
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        raise RuntimeError(f"group {group.name!r}: a message of {len(message)} bytes and "
                           f"{len(fds)} fds was truncated (limits: {MAX_HEADER_BYTES} bytes, "
                           f"{MAX_FDS} fds)")
    try:
        header = json.loads(message)
        sender, ranks = header["sender"], tuple(header["ranks"])
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"group {group.name!r}: a message's header {message[:200]!r} is "
                           f"not {{'sender': process, 'ranks': [...]}}") from e
    if sender not in group.peers or sender in senders:
        raise RuntimeError(f"group {group.name!r}: a message from process {sender!r}, which is "
                           f"not a peer still to send (peers {list(group.peers)}, already sent "
                           f"{sorted(senders)})")
    if ranks != group.ranks(sender) or len(fds) != len(ranks):
        raise RuntimeError(f"group {group.name!r}: process {sender} sent ranks {list(ranks)} "
                           f"with {len(fds)} fds; it owns ranks {list(group.ranks(sender))}")
    return sender, ranks


def _kinds(name, kinds) -> frozenset[str]:
    """`kinds` as a frozenset of handle kinds."""
    if isinstance(kinds, str):
        raise TypeError(f"{name}={kinds!r} must be a collection of kinds, not one str")
    kinds = frozenset(kinds)
    if not kinds <= set(KINDS):
        raise ValueError(f"{name}={sorted(kinds)} has unknown kinds {sorted(kinds - set(KINDS))}; "
                         f"kinds are {KINDS}")
    return kinds


def _host_names(machines) -> list[str]:
    """A label per machine of choose_kind: its hostname(s), or its whole identity where
    hostnames repeat across machines."""
    names = [" or ".join(sorted({h for _, h in procs})) for procs in machines.values()]
    if len(set(names)) == len(names):
        return names
    return [f"{n} ({HOST_SEPARATOR.join(m)})" for n, m in zip(names, machines)]
