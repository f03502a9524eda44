"""Sentinel-armed ("Lamport") mailboxes in peer-mapped GPU memory for the TP all-reduce.

Each rank owns one buffer, allocated with cuda-python's VMM API (cuMemCreate on the rank's
device, cuMemMap into one virtual range, cuMemSetAccess for every device of the mailbox), so a
single process's kernels read and write every rank's buffer through one address (unified VA).
A rank's buffer holds the regions of jax_kimik3/layout.py (the kernels address them from
the same module), rounded up to the allocation granularity; `arm()` writes SENTINEL into
every bf16 region and zeroes the control words. Which of the two buffers a call uses is
`calls % 2`, from the rank's own call counter in device memory, which the last kernel of every
all-reduce advances: the buffers alternate with the sequence of calls, whatever the layer.
Kernels find the buffers through the peer table (`peer_table`), an ordinary JAX input.
"Virtual TP" puts all T buffers on one device, so one GPU runs the protocol. A group whose
devices belong to several processes (`for_processes`) allocates each buffer in its owner
process with an exportable handle type and maps the others' from their exported handles
(jax_kimik3/handles.py carries them); each process's table holds its own mappings.
jax_kimik3/mesh_mailbox.py makes one mailbox per TP group of a larger mesh.
docs/protocol.md has the protocol: arming, one-shot, two-shot, fused, why two buffers are
safe, the memory model of every store and poll, timeouts and recovery.

`multicast=True` also binds the T buffers to one NVLink multicast object (cuMulticastCreate)
mapped at one more address: a `multimem.st` there lands in every rank's buffer, so a producer
publishes once instead of T times. It is refused outright where the environment disables
multicast (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as
on the shared test machines, where creating a multicast object can take GPUs out of service;
it has therefore never run here.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from jax_kimik3 import handles
from jax_kimik3.config import check_int
from jax_kimik3.layout import (CONTROL, DEFAULT_TIMEOUT_MS, SENTINEL, WAITERS, MailboxLayout,
                               MailboxSpec, align, check_timeout_ms, peer_table)

# The variables that turn NVLink multicast off, each with the value that does ("0": an enable
# switch, off where it reads as 0 or false; "1": a disable switch, on where it reads as
# anything but 0 or false, as NCCL, NVSHMEM and torch parse their switches).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
FALSE_WORDS = ("", "0", "n", "no", "f", "false", "off")


def _false(value: str) -> bool:
    text = value.strip().lower()
    return text in FALSE_WORDS or (text.lstrip("+-").isdigit() and int(text) == 0)


def refuse_multicast(environ=os.environ):
    """Raise if the environment disables NVLink multicast (the shared test machines do)."""
    for name, off in MULTICAST_OFF.items():
        value = environ.get(name)
        if value is not None and _false(value) == (off == "0"):
            raise RuntimeError(
                f"multicast mailbox refused: {name}={value!r} disables NVLink multicast here")


class Driver:
    """cuda-python's driver API, each call checked: a failure raises a RuntimeError that names
    the call and its arguments."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError as e:  # cuda-python is a dependency; its driver library may be absent
            raise RuntimeError(f"Mailbox needs CUDA GPUs and their driver: {e}") from None
        self.cu = driver

    def __call__(self, name, *args):
        error, *values = getattr(self.cu, name)(*args)
        if int(error) != 0:
            shown = ", ".join(_show(a) for a in args)
            raise RuntimeError(f"CUDA driver call {name}({shown}) failed: {error!r}")
        return values[0] if len(values) == 1 else values


def check_gpu_devices(where, devices) -> list:
    """`devices` as a list of distinct JAX CUDA devices, one per rank (ValueError otherwise)."""
    devices = list(devices)
    if not devices:
        raise ValueError(f"{where}: devices=[] must name at least one CUDA device")
    other = sorted({d.platform for d in devices} - {"gpu"})
    if other:
        raise ValueError(f"{where} needs CUDA GPU devices; got devices of platform {other} "
                         f"({devices[0]}): a mailbox lives in GPU memory")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{where}: devices={devices} name a device twice: one rank per device "
                         "(Mailbox.virtual puts every rank on one device)")
    return devices


def _show(arg):
    if isinstance(arg, int):
        return hex(arg) if arg > 4096 else str(arg)
    return type(arg).__name__


class Mailbox:
    """One sentinel-armed buffer per TP rank; create with `for_devices`, `for_processes` or
    `virtual`, then close.

    `ordinals`: the CUDA device of each rank's buffer (rank r on ordinals[r]; None for a rank
    of another process of `group`, a handles.ProcessGroup); `timeout_ms`:
    how long a kernel's wait for a peer may last before it gives up (writes NaN, marks the
    mailbox failed; `check()` raises it). Also a context manager. A mailbox collected open, or
    still open at interpreter exit, waits for its devices and is freed then: keep the mailbox
    itself, not only its `peer_table`, while kernels use its buffers. A freed mailbox's
    address ranges stay reserved: a kernel still given its peer table faults (an illegal
    address), it never reaches memory allocated since.
    """

    def __init__(self, ordinals, layout: MailboxLayout, *, multicast=False,
                 timeout_ms=DEFAULT_TIMEOUT_MS, group: handles.ProcessGroup | None = None):
        ordinals = tuple(ordinals)
        owned = [r for r in range(len(ordinals)) if group is None or group.owns(r)]
        for r in owned:
            check_int(f"ordinals[{r}]", ordinals[r], 0)
        if len(ordinals) != layout.tp:
            raise ValueError(f"ordinals={ordinals} name {len(ordinals)} devices; the layout "
                             f"has tp={layout.tp} ranks")
        local = [ordinals[r] for r in owned]
        self.spec = MailboxSpec(layout, multicast, timeout_ms, virtual=len(set(local)) < len(owned))
        if multicast:
            refuse_multicast()
            if self.spec.virtual:
                raise ValueError(f"multicast needs one device per rank; got ordinals={ordinals}")
            if group is not None:
                raise NotImplementedError("a multicast mailbox spans the devices of one process")
        self.ordinals, self.owned, self.group = ordinals, tuple(owned), group
        self._buffers = []  # (address, size, handle) of each rank, in rank order
        self._multicast = []  # (address, size, handle, ordinals) of the bound multicast object
        self._contexts = {}  # ordinal → its retained primary context
        self._cu = None
        try:
            self._cu = cu = Driver()
            try:
                cu("cuInit", 0)
            except RuntimeError as e:
                raise RuntimeError(f"Mailbox needs CUDA GPUs: {e}") from None
            count = cu("cuDeviceGetCount")
            if any(o >= count for o in local):
                raise ValueError(f"ordinals={ordinals}: this host has {count} CUDA devices")
            for o in sorted(set(local)):
                self._contexts[o] = cu("cuDevicePrimaryCtxRetain", cu("cuDeviceGet", o))
            if group is None:
                for ordinal in ordinals:
                    self._buffers.append(self._allocate(ordinal))
            else:
                self._buffers.extend(self._share(group))
            self.addresses = tuple(b[0] for b in self._buffers)
            if multicast:
                self._multicast.append(self._bind_multicast())
            self.peer_table = peer_table(self.addresses,
                                         self._multicast[0][0] if multicast else 0)
            self.arm()
        except BaseException as e:
            if group is not None:  # the other processes stop waiting for this one
                handles.abandon(group, f"making the mailbox: {type(e).__name__}: {e}")
            if self._cu is not None:
                self._release()
            raise
        # When the mailbox is collected or, at the latest, at interpreter exit: its devices
        # go idle, then its memory and contexts are released (nothing if it was closed).
        self._finalizer = weakref.finalize(self, Mailbox._collect, cu, self._contexts,
                                           self._buffers, self._multicast)

    @classmethod
    def for_devices(cls, devices, **kwargs):
        """One buffer on each JAX CUDA device of a TP mesh axis (rank r on devices[r])."""
        devices = check_gpu_devices("Mailbox.for_devices", devices)
        import jax

        foreign = [d for d in devices if d.process_index != jax.process_index()]
        if foreign:
            raise ValueError(
                f"devices {foreign} belong to other processes: Mailbox.for_devices spans the "
                "devices of this process; Mailbox.for_processes (or MeshMailbox) shares a "
                "group's buffers between processes")
        return cls([d.local_hardware_id for d in devices], MailboxLayout(len(devices)), **kwargs)

    @classmethod
    def for_processes(cls, devices, *, name, exchange_timeout_ms=handles.EXCHANGE_TIMEOUT_MS,
                      **kwargs):
        """One buffer on each JAX CUDA device of a TP group whose devices belong to several
        processes (jax.distributed): each process allocates its own ranks' buffers and maps
        the others' through exported handles (jax_kimik3/handles.py). Collective: every
        process with a device in `devices` calls it, with the same `name` (unique per
        mailbox: it names the exchange in the distributed key-value store).
        `exchange_timeout_ms` bounds each step of that exchange (a peer that never comes)."""
        check_timeout_ms(exchange_timeout_ms, "exchange_timeout_ms")
        devices = check_gpu_devices("Mailbox.for_processes", devices)
        import jax

        group = handles.ProcessGroup(name, jax.process_index(),
                                     tuple(d.process_index for d in devices),
                                     timeout_ms=exchange_timeout_ms)
        return cls([d.local_hardware_id if group.owns(r) else None
                    for r, d in enumerate(devices)], MailboxLayout(len(devices)), group=group,
                   **kwargs)

    @classmethod
    def virtual(cls, device, tp, **kwargs):
        """All `tp` ranks' buffers on one JAX CUDA device: "virtual TP"."""
        if getattr(device, "platform", None) != "gpu":
            raise ValueError(f"Mailbox.virtual needs a CUDA GPU device; got device={device!r}")
        check_int("tp", tp, 1)
        return cls([device.local_hardware_id] * tp, MailboxLayout(tp), **kwargs)

    @property
    def layout(self) -> MailboxLayout:
        return self.spec.layout

    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def multicast(self) -> bool:
        return self.spec.multicast

    @property
    def timeout_ms(self) -> float:
        return self.spec.timeout_ms

    @property
    def closed(self) -> bool:
        return not self._buffers

    def __repr__(self):
        state = "closed" if self.closed else f"timeout {self.timeout_ms:g} ms"
        where = ("" if self.group is None else
                 f", processes={list(self.group.processes)}")
        return f"Mailbox(tp={self.tp}, ordinals={list(self.ordinals)}{where}, {state})"

    def _access(self):
        """Read-write access descriptors for every device of the mailbox."""
        cu, access = self._cu.cu, []
        for peer in sorted(self._contexts):
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = peer
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access.append(desc)
        return access

    def _map(self, handle, size):
        """Reserve a virtual range, map `handle` there, open it to every device; its address.
        On a failure, what this call reserved or mapped is undone."""
        cu = self._cu
        address = cu("cuMemAddressReserve", size, 0, 0, 0)
        try:
            cu("cuMemMap", address, size, 0, handle, 0)
            try:
                access = self._access()
                cu("cuMemSetAccess", address, size, access, len(access))
            except BaseException:
                self._cu.cu.cuMemUnmap(address, size)
                raise
        except BaseException:
            self._cu.cu.cuMemAddressFree(address, size)
            raise
        return int(address)

    def _multicast_prop(self, size):
        cu = self._cu.cu
        prop = cu.CUmulticastObjectProp()
        prop.numDevices = len(self.ordinals)
        prop.size = size
        prop.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    def _bind_multicast(self):
        """One multicast object over every rank's buffer, mapped at its own address."""
        cu = self._cu
        size = self._buffers[0][1]
        handle = cu("cuMulticastCreate", self._multicast_prop(size))
        bound = []  # the ordinals whose buffer is bound: unbound again on a failure
        try:
            for ordinal in self.ordinals:
                cu("cuMulticastAddDevice", handle, cu("cuDeviceGet", ordinal))
            for (_, _, memory), ordinal in zip(self._buffers, self.ordinals):
                cu("cuCtxSetCurrent", self._contexts[ordinal])
                cu("cuMulticastBindMem", handle, 0, memory, 0, size, 0)
                bound.append(ordinal)
            return self._map(handle, size), size, handle, self.ordinals
        except BaseException:
            raw = self._cu.cu
            for ordinal in bound:
                raw.cuMulticastUnbind(handle, raw.cuDeviceGet(ordinal)[1], 0, size)
            raw.cuMemRelease(handle)
            raise

    def _allocate(self, ordinal, kind=None):
        """A buffer on device `ordinal`, mapped here: (address, size, handle); `kind` (a
        handles kind) makes it exportable."""
        cu = self._cu
        raw = cu.cu
        prop = raw.CUmemAllocationProp()
        prop.type = raw.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = raw.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        if kind is not None:
            prop.requestedHandleTypes = self._handle_type(kind)
        granularity = cu("cuMemGetAllocationGranularity", prop,
                         raw.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        if self.multicast:  # buffers bound to a multicast object: its granularity too
            granularity = max(int(granularity), int(cu(
                "cuMulticastGetGranularity", self._multicast_prop(self.layout.nbytes),
                raw.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM)))
        size = align(self.layout.nbytes, int(granularity))
        handle = cu("cuMemCreate", size, prop, 0)
        try:
            return self._map(handle, size), size, handle
        except BaseException:
            raw.cuMemRelease(handle)
            raise

    def _handle_type(self, kind):
        return getattr(self._cu.cu.CUmemAllocationHandleType, handles.HANDLE_TYPES[kind])

    def _supported(self):
        """The handle kinds every local device of the mailbox can export."""
        attribute = self._cu.cu.CUdevice_attribute
        return frozenset(kind for kind, name in handles.SUPPORT_ATTRIBUTES.items() if all(
            self._cu("cuDeviceGetAttribute", getattr(attribute, name), self._cu("cuDeviceGet", o))
            for o in self._contexts))

    def _share(self, group):
        """Every rank's buffer, mapped here: this process's ranks allocated, exported and
        sent to the group's other processes; theirs received, imported and mapped."""
        cu, raw = self._cu, self._cu.cu
        kind = handles.agree_kind(group, self._supported(), self.layout.nbytes)
        buffers = {}  # rank → (address, size, handle): what to free on a failure
        try:
            for r in self.owned:
                buffers[r] = self._allocate(self.ordinals[r], kind)
            own, exported = dict(buffers), {}
            try:
                for r, (_, _, handle) in own.items():
                    exported[r] = cu("cuMemExportToShareableHandle", handle,
                                     self._handle_type(kind), 0)
                received = handles.share(group, {
                    r: h if kind == handles.POSIX_FD else bytes(h.data)
                    for r, h in exported.items()}, kind)
            finally:
                if kind == handles.POSIX_FD:
                    for fd in exported.values():
                        os.close(fd)
            size = next(iter(own.values()))[1]
            try:
                for r, shared in sorted(received.items()):
                    if kind == handles.FABRIC:
                        shared = raw.CUmemFabricHandle()
                        shared.data = received[r]
                    handle = cu("cuMemImportFromShareableHandle", shared, self._handle_type(kind))
                    try:
                        buffers[r] = self._map(handle, size), size, handle
                    except BaseException:
                        raw.cuMemRelease(handle)
                        raise
            finally:  # an imported handle holds the memory; the descriptors are done with
                if kind == handles.POSIX_FD:
                    for fd in received.values():
                        os.close(fd)
        except BaseException:
            Mailbox._free(cu, list(buffers.values()), [])
            raise
        return [buffers[r] for r in range(self.tp)]

    def _synchronize(self):
        """Wait until every device of the mailbox is idle (every stream of its context)."""
        for ctx in self._contexts.values():
            self._cu("cuCtxSetCurrent", ctx)
            self._cu("cuCtxSynchronize")

    def _require_open(self, what):
        if self.closed:
            raise ValueError(f"{what}: mailbox={self!r} is closed")

    def arm(self):
        """Wait for every device of the mailbox to go idle, then write SENTINEL over every slot
        of every rank and zero the control words: the call counters restart together and a
        failure is cleared; rows a late peer left behind are wiped, never read."""
        self._require_open("Mailbox.arm")
        try:
            self._synchronize()  # no kernel may still use the slots
            if self.group is not None:  # nor any of the other processes' kernels
                handles.barrier(self.group, "arm")
            for r in self.owned:
                address = self._buffers[r][0]
                self._cu("cuCtxSetCurrent", self._contexts[self.ordinals[r]])
                self._cu("cuMemsetD32", address, SENTINEL, self.layout.armed_bytes // 4)
                self._cu("cuMemsetD32", address + self.layout.control, 0, CONTROL.WORDS)
            self._synchronize()
            if self.group is not None:  # no process publishes before every rank is armed
                handles.barrier(self.group, "armed")
        except BaseException as e:
            if self.group is not None:  # the other processes stop waiting for this one
                handles.abandon(self.group, f"Mailbox.arm: {type(e).__name__}: {e}")
            raise

    def read(self, rank, offset, nbytes, dtype=np.uint32) -> np.ndarray:
        """A host copy of `nbytes` of rank `rank`'s buffer from byte `offset` (for checks);
        waits for the devices first."""
        self._require_open("Mailbox.read")
        check_int("rank", rank, 0, self.tp - 1)
        size = self._buffers[rank][1]
        check_int("offset", offset, 0, size)
        itemsize = np.dtype(dtype).itemsize
        if check_int("nbytes", nbytes, 0, size - offset) % itemsize:
            raise ValueError(f"nbytes={nbytes} must be a multiple of {itemsize} (dtype={dtype})")
        out = np.empty(nbytes // itemsize, dtype)
        self._synchronize()
        self._cu("cuMemcpyDtoH", out.ctypes.data, self.addresses[rank] + offset, nbytes)
        return out

    def unarmed(self) -> int:
        """Words of every rank's armed regions not holding SENTINEL: 0 between calls, when
        every consumer has re-armed what it read (for checks; waits for the GPUs)."""
        return sum(int(np.count_nonzero(self.read(r, 0, self.layout.armed_bytes) != SENTINEL))
                   for r in range(self.tp))

    def control(self) -> np.ndarray:
        """uint32 [TP, CONTROL.WORDS]: every rank's control words (waits for the GPUs)."""
        return np.stack([self.read(r, self.layout.control, 4 * CONTROL.WORDS)
                         for r in range(self.tp)])

    def calls(self) -> list[int]:
        """All-reduces each rank has completed since the last `arm`."""
        return [int(c) for c in self.control()[:, CONTROL.CALLS]]

    def timed_out(self) -> list[int]:
        """The ranks whose own wait gave up since the last `arm`."""
        return [r for r, words in enumerate(self.control()) if words[CONTROL.MISSING]]

    def check(self):
        """Raise TimeoutError if a wait on this mailbox gave up since the last `arm`: which
        ranks, in which call, waiting for whom. Until `arm()` every call on it writes NaN."""
        words = self.control()
        failures = []
        for rank, w in enumerate(words):
            if w[CONTROL.MISSING]:
                missing = [q for q in range(self.tp) if int(w[CONTROL.MISSING]) >> q & 1]
                failures.append(
                    f"rank {rank} ({WAITERS.get(int(w[CONTROL.WAITER]), 'a kernel')}) gave up "
                    f"in call {int(w[CONTROL.TIMED_OUT]) + 1} since arm() waiting for rows of "
                    f"rank(s) {missing}")
        if failures or words[:, CONTROL.FAILED].any():
            failed = [r for r in range(self.tp) if words[r, CONTROL.FAILED]]
            where = (f"devices {list(self.ordinals)}" if self.group is None else
                     f"the devices of processes {list(self.group.processes)}")
            how = ("it waits for every device to go idle first" if self.group is None else
                   "collective: every process of the group calls it, each once its devices "
                   "are idle")
            raise TimeoutError(
                f"mailbox tp={self.tp} on {where}: "
                + ("; ".join(failures) or "marked failed") + f" (after {self.timeout_ms:g} ms). "
                f"Ranks {failed} are marked failed: every call on this mailbox writes NaN until "
                f"Mailbox.arm() re-arms it ({how})")

    @staticmethod
    def _collect(cu, contexts, buffers, multicast):
        """The finalizer: a mailbox collected open waits for its devices (a kernel may still
        use its buffers), then frees them and releases its contexts."""
        if not contexts:  # closed (or never opened): nothing left
            return
        raw = cu.cu
        for ctx in contexts.values():  # best effort: a device with a sticky error still frees
            raw.cuCtxSetCurrent(ctx)
            raw.cuCtxSynchronize()
        Mailbox._free(cu, buffers, multicast)
        for ordinal in contexts:
            raw.cuDevicePrimaryCtxRelease(raw.cuDeviceGet(ordinal)[1])
        contexts.clear()

    @staticmethod
    def _free(cu, buffers, multicast):
        """Unmap and release the memory, and keep each virtual range reserved, unmapped, for
        the life of the process: a peer table kept past its mailbox then points at addresses
        no later allocation (another mailbox, XLA's) can get, and a kernel given it faults
        with an illegal address instead of writing into someone else's memory."""
        raw = cu.cu
        for address, size, handle, ordinals in multicast:
            raw.cuMemUnmap(address, size)
            for ordinal in ordinals:
                raw.cuMulticastUnbind(handle, raw.cuDeviceGet(ordinal)[1], 0, size)
            raw.cuMemRelease(handle)
        multicast.clear()
        for address, size, handle in buffers:
            raw.cuMemUnmap(address, size)
            raw.cuMemRelease(handle)
        buffers.clear()

    def _release(self):
        Mailbox._free(self._cu, self._buffers, self._multicast)
        for ordinal in self._contexts:
            self._cu.cu.cuDevicePrimaryCtxRelease(self._cu.cu.cuDeviceGet(ordinal)[1])
        self._contexts.clear()  # in place: the finalizer holds the same dict

    def close(self):
        """Wait for every device of the mailbox to go idle, then free every buffer; closing
        twice is harmless. A closed mailbox is refused by every call."""
        try:
            if self._buffers:
                self._synchronize()
        finally:  # a device that cannot synchronize (a sticky error) still gets its memory back
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
