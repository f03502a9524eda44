"""Mailboxes for a whole mesh: one TP group per index of the mesh's other axes, each with its
own buffers, and the peer table as a per-device operand.

A mesh ("dp", "tp") = (2, 8) has two TP groups of eight devices; a mailbox shared by both
would let one group's rows land in the other's slots. `MeshMailbox(mesh, "tp")` makes one
`Mailbox` per group, its buffers on the group's own devices, and `table`: a jax.Array of
shape mesh.devices.shape + (T + 1, 2), sharded over every mesh axis, whose block on a device
is that device's group's peer table as the device's own process maps the buffers. Inside
shard_map (in_specs `table_spec`) each device reads its own block, so no process's addresses
are baked into a program that another process runs, and a compiled or exported step serves
whichever mailbox's table it is given.

A group whose devices belong to several processes (one process per GPU, started with
jax.distributed) allocates each buffer in its owner process and shares it with the others
through exportable handles (jax_kimik3/handles.py). Creating and arming are then
collective: every process of the mesh calls them, in the same order. Closing is not: an
imported handle keeps the memory alive until the last process that mapped it lets it go.
"""

from __future__ import annotations

import collections
import hashlib

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kimik3 import handles
from jax_kimik3.layout import DEFAULT_TIMEOUT_MS, MailboxLayout, MailboxSpec, check_timeout_ms
from jax_kimik3.mailbox import Mailbox, check_gpu_devices

_created = collections.Counter()  # MeshMailboxes made here per mesh and axis (see _name)


def _name(mesh, axis_name) -> str:
    """A name for a new MeshMailbox's exchanges that every process derives alike: the mesh's
    devices and axes, the axis, and how many mailboxes of that mesh and axis came before
    (creation is collective, so every process has made as many)."""
    what = repr((mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat],
                 axis_name))
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    _created[digest] += 1
    return f"mesh_mailbox/{digest}/{_created[digest] - 1}"


def table_spec(mesh) -> P:
    """shard_map's in_specs of a per-device table on `mesh`: one block per device."""
    return P(*mesh.axis_names)


def groups(mesh, axis_name) -> np.ndarray:
    """The devices of `mesh` as [groups, size of axis_name]: group g the devices along the
    axis at the g-th index (row-major) of the other axes, rank r the r-th of them."""
    axis = mesh.axis_names.index(axis_name)
    return np.moveaxis(mesh.devices, axis, -1).reshape(-1, mesh.shape[axis_name])


def table_array(mesh, axis_name, tables) -> jax.Array:
    """The per-device peer tables of `mesh`: a jax.Array of mesh.devices.shape + table shape,
    sharded over every axis, whose block on a device is tables[its group] (group index →
    uint32 [T + 1, 2], for every group with a device of this process)."""
    rows = groups(mesh, axis_name)
    group_of = {d.id: g for g, devices in enumerate(rows) for d in devices}
    ndim = mesh.devices.ndim
    shape = next(iter(tables.values())).shape

    def block(index):
        device = mesh.devices[tuple(s.start or 0 for s in index[:ndim])]
        return tables[group_of[device.id]].reshape((1,) * ndim + shape)

    return jax.make_array_from_callback((*mesh.devices.shape, *shape),
                                        NamedSharding(mesh, table_spec(mesh)), block)


def _give_up(rows, name, reason):
    """This process gives up on every group of `rows` that spans several processes and has
    one of its devices, made or not: the other processes' waits in those groups' exchanges
    stop at once with `reason` (handles.abandon) instead of running out their timeout."""
    me = jax.process_index()
    for g, devices in enumerate(rows):
        processes = tuple(d.process_index for d in devices)
        if me in processes and len(set(processes)) > 1:
            try:
                group = handles.ProcessGroup(f"{name}/group{g}", me, processes)
            except Exception:  # noqa: BLE001 (no store to tell: the peers time out)
                continue
            handles.abandon(group, reason)


class MeshMailbox:
    """One Mailbox per group of `mesh`'s devices along `axis_name` (rank r of a group on its
    r-th device along the axis); `table` and `table_spec` are the per-device peer tables and
    their shard_map spec. `multicast`, `timeout_ms` as for Mailbox, `exchange_timeout_ms` as
    for Mailbox.for_processes. Close it (or use it as a context manager); `check()` raises
    the failure of any group this process serves."""

    def __init__(self, mesh, axis_name="tp", *, multicast=False, timeout_ms=DEFAULT_TIMEOUT_MS,
                 exchange_timeout_ms=handles.EXCHANGE_TIMEOUT_MS):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh (of CUDA devices)")
        me = jax.process_index()
        if not any(d.process_index == me for d in mesh.devices.flat):
            raise ValueError(f"mesh {dict(mesh.shape)} has no device of process {me}: a "
                             "MeshMailbox is made by the processes of its mesh")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                             f"{dict(mesh.shape)}")
        check_timeout_ms(exchange_timeout_ms, "exchange_timeout_ms")
        check_gpu_devices("MeshMailbox", mesh.devices.flat)
        self.mesh, self.axis_name = mesh, axis_name
        rows = groups(mesh, axis_name)
        self.spec = MailboxSpec(MailboxLayout(rows.shape[1]), multicast, timeout_ms,
                                groups=len(rows))
        name = _name(mesh, axis_name)
        self._groups = {}  # group index → the Mailbox of a group with a device of this process
        try:
            for g, devices in enumerate(rows):
                if not any(d.process_index == me for d in devices):
                    continue
                if all(d.process_index == me for d in devices):
                    self._groups[g] = Mailbox.for_devices(
                        devices, multicast=multicast, timeout_ms=timeout_ms)
                else:
                    self._groups[g] = Mailbox.for_processes(
                        devices, name=f"{name}/group{g}", multicast=multicast,
                        timeout_ms=timeout_ms, exchange_timeout_ms=exchange_timeout_ms)
            self.table = table_array(mesh, axis_name, {g: m.peer_table
                                                       for g, m in self._groups.items()})
        except BaseException as e:
            _give_up(rows, name, f"MeshMailbox: {type(e).__name__}: {e}")
            self.close()
            raise

    @property
    def table_spec(self) -> P:
        """shard_map's in_specs for `table`: one block per device."""
        return table_spec(self.mesh)

    @property
    def mailboxes(self) -> dict[int, Mailbox]:
        """The groups this process has a device in: group index → its Mailbox."""
        return dict(self._groups)

    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def closed(self) -> bool:
        return not self._groups

    def __repr__(self):
        state = "closed" if self.closed else f"timeout {self.spec.timeout_ms:g} ms"
        return (f"MeshMailbox(mesh={dict(self.mesh.shape)}, axis_name={self.axis_name!r}, "
                f"groups={self.spec.groups}, {state})")

    def _require_open(self, what):
        if self.closed:
            raise ValueError(f"{what}: mailbox={self!r} is closed")

    def arm(self):
        """Re-arm every group (collective: each group's processes arm it together)."""
        self._require_open("MeshMailbox.arm")
        for mailbox in self._groups.values():
            mailbox.arm()

    def calls(self) -> dict[int, list[int]]:
        """Group index → all-reduces each of its ranks has completed since the last arm."""
        self._require_open("MeshMailbox.calls")
        return {g: m.calls() for g, m in self._groups.items()}

    def check(self):
        """Raise TimeoutError if a wait of any group this process serves gave up."""
        self._require_open("MeshMailbox.check")
        failures = []
        for g, mailbox in self._groups.items():
            try:
                mailbox.check()
            except TimeoutError as e:
                failures.append(f"group {g}: {e}")
        if failures:
            raise TimeoutError("; ".join(failures))

    def close(self):
        """Close every group's mailbox (each waits for its devices first); twice is harmless."""
        groups, self._groups = self._groups, {}
        errors = []
        for mailbox in groups.values():  # every one, whatever another's close raised
            try:
                mailbox.close()
            except Exception as e:  # noqa: BLE001 (raised below, after the others are closed)
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
