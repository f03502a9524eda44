"""The key-value store of jax.distributed as the mailboxes' exchanges use it: keys under one
namespace, blocking reads with deadlines whose TimeoutError says what was awaited from whom,
and barriers among a subset of the processes.

Protocol of a barrier among some processes (`Store.barrier`; the lowest id leads):
1. Each process sets <name>/arrived/<its id>.
2. The leader reads every arrival, then sets <name>/released.
3. Every other process reads the release, then sets <name>/left/<its id>.
4. The leader reads every departure, then deletes <name> and everything under it.
So the processes outside the barrier never take part, and no key outlives a collective that
succeeds: a long-running server may create mailboxes forever without growing the store. (The
price: the leader returns only once every other process has left, so a process that dies just
after the release makes the leader time out.)
"""

from __future__ import annotations

import math
import time

from jax_kimik3.config import check_int
from jax_kimik3.layout import check_timeout_ms

NAMESPACE = "jax_kimik3"  # the root of every key this package sets
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # how a timed-out blocking get of the store begins
WATCH_MS = 200  # a wait that watches for processes that gave up looks this often


class Abandoned(RuntimeError):
    """A process that a wait needed gave up (it said so under the wait's `watch` directory)."""


class Deadline:
    """The end of a collective that may take `timeout_ms` in all."""

    def __init__(self, timeout_ms):
        self.timeout_ms = check_timeout_ms(timeout_ms)
        self.end = time.monotonic() + timeout_ms / 1000

    def left_ms(self) -> int:
        """Milliseconds left (0 once past)."""
        return max(0, math.ceil((self.end - time.monotonic()) * 1000))

    def left_s(self) -> float:
        """Seconds left for a socket's timeout: at least a millisecond (0 would not wait)."""
        return max(self.left_ms(), 1) / 1000


def members_of(name, processes, process_id) -> tuple[int, ...]:
    """`processes` as sorted distinct ids, checked to include `process_id`."""
    processes = list(processes)
    members = tuple(sorted({check_int(f"{name} entry", p, 0) for p in processes}))
    if process_id not in members:
        raise ValueError(f"{name}={processes} must include this process, {process_id}")
    return members


class Store:
    """The key-value store of the distributed runtime (jax.distributed), as one process sees
    it: every key under NAMESPACE, and timeouts that say what was awaited from whom."""

    def __init__(self, client=None, *, process_id=None):
        if client is None:
            from jax._src import distributed

            state = distributed.global_state
            if state.client is None:
                raise RuntimeError(
                    "Store needs the distributed runtime: call jax.distributed.initialize(...) "
                    "in every process first (jax._src.distributed.global_state.client is None)")
            if process_id is not None and process_id != state.process_id:
                raise ValueError(f"process_id={process_id!r} is not this process's id in "
                                 f"jax.distributed ({state.process_id})")
            client, process_id = state.client, state.process_id
        elif process_id is None:
            raise ValueError("Store(client=...) needs process_id: this process's id in the "
                             "client's runtime")
        self.client = client
        self.process_id = check_int("process_id", process_id, 0)

    def key(self, key: str) -> str:
        """The store's key for `key`."""
        return f"{NAMESPACE}/{key}"

    def set(self, key: str, value: bytes) -> None:
        """Set `key` once (setting it again raises the store's ALREADY_EXISTS)."""
        if not isinstance(value, bytes):
            raise TypeError(f"the value of key {self.key(key)!r} must be bytes, "
                            f"not {type(value).__name__}")
        self.client.key_value_set_bytes(self.key(key), value)

    def get(self, key: str, timeout_ms: float, *, writer=None, watch=None) -> bytes:
        """`key`'s value, waiting up to `timeout_ms` for process `writer` to set it. With
        `watch` (a directory where processes that gave up say why: `abandon`), the wait looks
        there every WATCH_MS and raises Abandoned as soon as one has."""
        deadline = Deadline(max(timeout_ms, 1))
        while True:
            self.check_watch(watch)
            step = deadline.left_ms() if watch is None else min(deadline.left_ms(), WATCH_MS)
            try:
                return self.client.blocking_key_value_get_bytes(self.key(key), max(step, 1))
            except RuntimeError as e:  # jax.errors.JaxRuntimeError, with the status in its text
                if not str(e).startswith(DEADLINE_EXCEEDED):
                    raise
                if deadline.left_ms() > 0:
                    continue
                self.check_watch(watch)
                by = "" if writer is None else f" by process {writer}"
                raise TimeoutError(f"key {self.key(key)!r} was not set{by} within "
                                   f"{timeout_ms:g} ms (process {self.process_id} waited)") from e

    def abandon(self, watch: str, reason: str) -> None:
        """Say under `watch` that this process gave up, and why: the waits that watch it stop
        at once (a second call keeps the first reason)."""
        if f"{self.process_id}" not in self.listing(watch):
            self.set(f"{watch}/{self.process_id}", reason.encode())

    def check_watch(self, watch) -> None:
        """Raise Abandoned if a process has given up under `watch` (None: nothing to watch)."""
        if watch is None:
            return
        gave_up = self.listing(watch)
        if gave_up:
            said = "; ".join(f"process {p}: {v.decode(errors='replace')}"
                             for p, v in sorted(gave_up.items()))
            raise Abandoned(f"{self.key(watch)}: a process gave up ({said})")

    def listing(self, directory: str) -> dict[str, bytes]:
        """The keys set under `directory` now (relative to it) and their values."""
        prefix = self.key(directory) + "/"
        return {k[len(prefix):]: v
                for k, v in self.client.key_value_dir_get_bytes(self.key(directory))}

    def delete(self, key: str) -> None:
        """Delete `key` and every key under it (none there is no error)."""
        self.client.key_value_delete(self.key(key))

    def barrier(self, name: str, processes, timeout_ms: float) -> None:
        """Wait until each of `processes` (this one among them) has called barrier(name, ...):
        the others take no part, so groups of a mesh sync apart. A name serves one barrier."""
        members = members_of("processes", processes, self.process_id)
        self.barrier_until(name, members, Deadline(timeout_ms))

    def barrier_until(self, name, members, deadline, watch=None):
        """The barrier of the module docstring among `members` (sorted ids, this process
        among them), within `deadline` (a Deadline another wait may share); `watch` as
        for `get`."""
        leader, me = members[0], self.process_id
        others = [p for p in members if p != me]
        what = f"barrier {self.key(name)!r} of processes {list(members)}"
        self.set(f"{name}/arrived/{me}", b"")
        if me == leader:
            self.gather(f"{name}/arrived", others, deadline, what, "never arrived", watch)
            self.set(f"{name}/released", b"")
            self.gather(f"{name}/left", others, deadline, what, "never left after the release",
                        watch)
            self.delete(name)
            return
        try:
            self.get(f"{name}/released", deadline.left_ms(), writer=leader, watch=watch)
        except TimeoutError as e:
            arrived = self.listing(f"{name}/arrived")
            missing = [p for p in members if str(p) not in arrived]
            why = (f"process(es) {missing} never arrived" if missing else
                   f"every process arrived, but the leader, process {leader}, never released")
            raise TimeoutError(f"{what}: {why} within {deadline.timeout_ms:g} ms "
                               f"(process {me} waited)") from e
        self.set(f"{name}/left/{me}", b"")

    def gather(self, directory, processes, deadline, what, never, watch=None) -> dict[int, bytes]:
        """directory/<p> of each process p, within `deadline`; the TimeoutError names every
        process whose key is missing ("`what`: process(es) <missing> `never` within ...");
        `watch` as for `get`."""
        values = {}
        for p in processes:
            try:
                values[p] = self.get(f"{directory}/{p}", deadline.left_ms(), writer=p,
                                     watch=watch)
            except TimeoutError as e:
                present = self.listing(directory)
                missing = [q for q in processes if str(q) not in present] or [p]
                raise TimeoutError(
                    f"{what}: process(es) {missing} {never} within {deadline.timeout_ms:g} ms "
                    f"(process {self.process_id} waited for keys {self.key(directory)}/<process>)"
                ) from e
        return values
