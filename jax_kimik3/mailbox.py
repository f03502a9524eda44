"""Sentinel-armed ("Lamport") mailboxes in peer-mapped GPU memory for the TP all-reduce.

Each rank owns one buffer, allocated with cuda-python's VMM API (cuMemCreate on the rank's
device, cuMemMap into one virtual range, cuMemSetAccess for every device of the mesh), so a
single process's kernels read and write every rank's buffer through one address (unified VA).
A rank's buffer, bf16 unless said, at these byte offsets (T = TP, C = capacity rows, H = hidden):

| region | shape | bytes |
|---|---|---|
| one-shot slots | [2 parities, T ranks, C, H] | 2·T·C·H·2 |
| two-shot receive | [2, T ranks, C, H/T] (chunk `rank` of each peer's rows) | 2·C·H·2 |
| two-shot gather | [2, C, H] (every owner's reduced chunk) | 2·C·H·2 |
| status | one int32: 1 after a consumer's bounded spin timed out | 4 |

rounded up to the allocation granularity. Every bf16 region is armed with the 32-bit word
0x80000000 (SENTINEL); status starts at 0. Kernels find the buffers through the peer table:
uint32 [T + 1, 2] = (low, high) words of each rank's address, then of the multicast address
(0 without one): an ordinary JAX input, no x64 needed. "Virtual TP" puts all T buffers on one
device, so one GPU runs the protocol.

`multicast=True` also binds the T buffers to one NVLink multicast object (cuMulticastCreate)
mapped at one more address: a `multimem.st` there lands in every rank's buffer, so a producer
publishes once instead of T times. It is refused outright where the environment disables
multicast (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as
on the shared test machines, where creating a multicast object can take GPUs out of service;
it has therefore never run here.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import numpy as np

from jax_kimik3.config import KIMI_K3

SENTINEL = 0x80000000  # fp32 -0: a mailbox word no producer can publish (bf16 -0 becomes +0)
PARITIES = 2  # layer i uses parity i % 2; why two suffice: jax_kimik3/kernels/lamport.py
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_ALIGN = 256


def _align(n, to=_ALIGN):
    return (n + to - 1) // to * to


@dataclasses.dataclass(frozen=True)
class MailboxLayout:
    """Byte offsets inside one rank's buffer (see the module docstring); pure arithmetic."""

    tp: int
    capacity: int = KIMI_K3.mailbox_capacity
    hidden: int = KIMI_K3.hidden_size

    def __post_init__(self):
        if self.tp < 1 or self.hidden % (8 * self.tp):
            raise ValueError(f"tp={self.tp} must be >= 1 and divide hidden={self.hidden} into "
                             "whole 8-element vectors")
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")

    @property
    def row_bytes(self) -> int:
        return self.hidden * 2

    @property
    def chunk(self) -> int:
        """Columns of the two-shot chunk each rank owns: H / TP."""
        return self.hidden // self.tp

    def slot(self, parity: int, rank: int, row: int = 0) -> int:
        """Row `row` of the one-shot slot that rank `rank` publishes into, at `parity`."""
        return ((parity * self.tp + rank) * self.capacity + row) * self.row_bytes

    @property
    def one_shot_bytes(self) -> int:
        return PARITIES * self.tp * self.capacity * self.row_bytes

    def receive(self, parity: int, rank: int, row: int = 0) -> int:
        """Row `row` of the two-shot receive slot of sending rank `rank`: H/T columns."""
        chunk_bytes = self.chunk * 2
        return self.one_shot_bytes + ((parity * self.tp + rank) * self.capacity + row) * chunk_bytes

    def gather(self, parity: int, row: int = 0) -> int:
        """Row `row` of the two-shot gather region at `parity`."""
        return self.one_shot_bytes + PARITIES * self.capacity * self.row_bytes + (
            parity * self.capacity + row) * self.row_bytes

    @property
    def armed_bytes(self) -> int:
        """The sentinel-armed prefix of the buffer: every bf16 region."""
        return self.gather(PARITIES)

    @property
    def status(self) -> int:
        return _align(self.armed_bytes)

    @property
    def nbytes(self) -> int:
        return self.status + _ALIGN


@dataclasses.dataclass(frozen=True)
class MailboxSpec:
    """What a traced step needs to know of a mailbox, without its memory: the layout and
    whether it is multicast. With it, the peer table travels as an operand (`peer_table=`),
    so a compiled or exported step is not tied to one process's buffer addresses."""

    layout: MailboxLayout
    multicast: bool = False

    @property
    def tp(self) -> int:
        return self.layout.tp


def refuse_multicast(environ=os.environ):
    """Raise if the environment disables NVLink multicast (the shared test machines do)."""
    for name, off in MULTICAST_OFF.items():
        if environ.get(name) == off:
            raise RuntimeError(
                f"multicast mailbox refused: {name}={off} disables NVLink multicast here")


def peer_table(addresses, multicast=0) -> np.ndarray:
    """uint32 [T + 1, 2]: each rank buffer's address, then the multicast address (0: none),
    as (low, high) 32-bit words."""
    words = np.asarray([*addresses, multicast], np.uint64).view(np.uint32)
    return words.reshape(len(addresses) + 1, 2)


def _check(result):
    """cuda-python returns (error, *values): raise on an error, return the values."""
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver call failed: {error!r}")
    return values[0] if len(values) == 1 else values


class Mailbox:
    """One sentinel-armed buffer per TP rank; create with `for_devices` or `virtual`, then close.

    Also a context manager; buffers still open at interpreter exit are freed then.
    """

    def __init__(self, ordinals, layout: MailboxLayout, *, multicast=False):
        ordinals = tuple(ordinals)
        if multicast:
            refuse_multicast()
            if len(set(ordinals)) != len(ordinals):
                raise ValueError(f"multicast needs one device per rank; got ordinals={ordinals}")
        from cuda.bindings import driver as cu

        self._cu, self.layout, self.ordinals, self.multicast = cu, layout, ordinals, multicast
        _check(cu.cuInit(0))
        self._contexts = {o: _check(cu.cuDevicePrimaryCtxRetain(_check(cu.cuDeviceGet(o))))
                          for o in set(self.ordinals)}
        self._buffers = []  # (address, size, handle)
        self._multicast = []  # (address, size, handle, ordinals) of the bound multicast object
        try:
            for ordinal in self.ordinals:
                self._buffers.append(self._allocate(ordinal))
            self.addresses = tuple(b[0] for b in self._buffers)
            if multicast:
                self._multicast.append(self._bind_multicast())
            self.peer_table = peer_table(self.addresses,
                                         self._multicast[0][0] if multicast else 0)
            self.arm()
        except BaseException:
            self.close()
            raise
        # Frees the memory when the mailbox is collected or, at the latest, at interpreter exit.
        self._finalizer = weakref.finalize(self, Mailbox._free, cu, self._buffers,
                                           self._multicast)

    @classmethod
    def for_devices(cls, devices, **kwargs):
        """One buffer on each JAX device of a TP mesh axis (rank r on devices[r])."""
        ordinals = [d.local_hardware_id for d in devices]
        return cls(ordinals, MailboxLayout(len(ordinals)), **kwargs)

    @classmethod
    def virtual(cls, device, tp, **kwargs):
        """All `tp` ranks' buffers on one JAX device: "virtual TP"."""
        return cls([device.local_hardware_id] * tp, MailboxLayout(tp), **kwargs)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def spec(self) -> MailboxSpec:
        """This mailbox's spec, for steps that take the peer table as an operand."""
        return MailboxSpec(self.layout, self.multicast)

    def _access(self):
        """Read-write access descriptors for every device of the mesh."""
        cu, access = self._cu, []
        for peer in sorted(set(self.ordinals)):
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = peer
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access.append(desc)
        return access

    def _map(self, handle, size):
        """Reserve a virtual range, map `handle` there, open it to every device; its address."""
        cu = self._cu
        address = _check(cu.cuMemAddressReserve(size, 0, 0, 0))
        _check(cu.cuMemMap(address, size, 0, handle, 0))
        access = self._access()
        _check(cu.cuMemSetAccess(address, size, access, len(access)))
        return int(address)

    def _multicast_prop(self, size):
        cu = self._cu
        prop = cu.CUmulticastObjectProp()
        prop.numDevices = len(self.ordinals)
        prop.size = size
        prop.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    def _bind_multicast(self):
        """One multicast object over every rank's buffer, mapped at its own address."""
        cu = self._cu
        size = self._buffers[0][1]
        handle = _check(cu.cuMulticastCreate(self._multicast_prop(size)))
        for ordinal in self.ordinals:
            _check(cu.cuMulticastAddDevice(handle, _check(cu.cuDeviceGet(ordinal))))
        for (_, _, memory), ordinal in zip(self._buffers, self.ordinals):
            _check(cu.cuCtxSetCurrent(self._contexts[ordinal]))
            _check(cu.cuMulticastBindMem(handle, 0, memory, 0, size, 0))
        return self._map(handle, size), size, handle, self.ordinals

    def _allocate(self, ordinal):
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        granularity = _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        if self.multicast:  # buffers bound to a multicast object: its granularity too
            granularity = max(int(granularity), int(_check(cu.cuMulticastGetGranularity(
                self._multicast_prop(self.layout.nbytes),
                cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM))))
        size = _align(self.layout.nbytes, int(granularity))
        handle = _check(cu.cuMemCreate(size, prop, 0))
        return self._map(handle, size), size, handle

    def _synchronize(self):
        for ordinal, ctx in self._contexts.items():
            _check(self._cu.cuCtxSetCurrent(ctx))
            _check(self._cu.cuCtxSynchronize())

    def arm(self):
        """Write SENTINEL over every slot of every rank and clear the status words."""
        self._synchronize()  # no kernel may still use the slots
        for (address, _, _), ordinal in zip(self._buffers, self.ordinals):
            _check(self._cu.cuCtxSetCurrent(self._contexts[ordinal]))
            _check(self._cu.cuMemsetD32(address, SENTINEL, self.layout.armed_bytes // 4))
            _check(self._cu.cuMemsetD32(address + self.layout.status, 0, 1))
        self._synchronize()

    def read(self, rank, offset, nbytes, dtype=np.uint32) -> np.ndarray:
        """A host copy of `nbytes` of rank `rank`'s buffer from byte `offset` (for checks)."""
        out = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
        self._synchronize()
        _check(self._cu.cuMemcpyDtoH(out.ctypes.data, self.addresses[rank] + offset, nbytes))
        return out

    def unarmed(self) -> int:
        """Words of every rank's armed regions not holding SENTINEL: 0 between steps, when
        every consumer has re-armed what it read (for checks; waits for the GPUs)."""
        return sum(int(np.count_nonzero(self.read(r, 0, self.layout.armed_bytes) != SENTINEL))
                   for r in range(self.tp))

    def timed_out(self) -> list[int]:
        """The ranks whose consumer's bounded spin gave up since the last `arm`."""
        return [r for r in range(self.tp) if self.read(r, self.layout.status, 4)[0]]

    def check(self):
        """Raise TimeoutError if any consumer timed out waiting for a peer. After one, the
        slots may hold a late peer's rows: `arm()` again (with every peer idle) before reuse."""
        ranks = self.timed_out()
        if ranks:
            raise TimeoutError(f"mailbox consumers of ranks {ranks} timed out waiting for a peer")

    @staticmethod
    def _free(cu, buffers, multicast):
        for address, size, handle, ordinals in multicast:
            cu.cuMemUnmap(address, size)
            cu.cuMemAddressFree(address, size)
            for ordinal in ordinals:
                cu.cuMulticastUnbind(handle, cu.cuDeviceGet(ordinal)[1], 0, size)
            cu.cuMemRelease(handle)
        multicast.clear()
        for address, size, handle in buffers:
            cu.cuMemUnmap(address, size)
            cu.cuMemAddressFree(address, size)
            cu.cuMemRelease(handle)
        buffers.clear()

    def close(self):
        """Free every buffer, once the GPU has finished with them; closing twice is harmless."""
        if self._buffers:
            self._synchronize()
        Mailbox._free(self._cu, self._buffers, self._multicast)
        for ordinal in self._contexts:
            self._cu.cuDevicePrimaryCtxRelease(self._cu.cuDeviceGet(ordinal)[1])
        self._contexts = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
