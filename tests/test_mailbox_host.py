"""CPU: the mailbox's host side (allocation, failure cleanup, close, collection, reads of the
control words) against a stand-in for cuda-python's driver API: host memory behind every
mapping, every live resource counted, any one call made to fail."""

import ctypes
import gc
import types

import numpy as np
import pytest
from jax.sharding import Mesh

import jax
import jax_kimik3 as k3
from jax_kimik3 import mailbox as mailbox_module
from jax_kimik3.layout import CONTROL, SENTINEL, MailboxLayout, MailboxSpec
from jax_kimik3.mailbox import Mailbox


GRANULARITY = 1 << 21  # the stand-in driver's allocation granularity


def allocated(layout):
    """Bytes of each rank's buffer on the stand-in driver: the layout's, rounded up."""
    return layout.nbytes + (-layout.nbytes) % GRANULARITY


class FakeDriver:
    """The driver calls Mailbox makes, on host memory; `fail_at`: the n-th call (1-based)
    returns an error."""

    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_NONE=0)
    CUmulticastGranularity_flags = types.SimpleNamespace(CU_MULTICAST_GRANULARITY_MINIMUM=0)

    def __init__(self, devices=8, fail_at=None):
        self.devices, self.fail_at, self.calls = devices, fail_at, []
        self.handles, self.ranges, self.mapped, self.contexts = set(), {}, set(), {}
        self.retired = {}  # address → size of the ranges unmapped and still reserved
        self.bound = {}  # multicast handle → devices whose memory is bound to it
        self._next = 1

    @staticmethod
    def CUmemAllocationProp():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    @staticmethod
    def CUmemAccessDesc():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    @staticmethod
    def CUmulticastObjectProp():
        return types.SimpleNamespace()

    def __getattr__(self, name):
        impl = getattr(self, "_" + name)

        def call(*args):
            self.calls.append(name)
            if len(self.calls) == self.fail_at:
                return 701, None  # an error, and what Driver does not read after one
            return (0, *impl(*args))
        return call

    def _new(self):
        self._next += 1
        return self._next

    def leaks(self):
        """What is still held: handles, address ranges (other than the unmapped ones Mailbox
        keeps reserved), mappings, context references."""
        return {name: held for name, held in (
            ("handles", self.handles), ("ranges", set(self.ranges) - set(self.retired)),
            ("mapped", self.mapped),
            ("bound", {h: n for h, n in self.bound.items() if n}), ("contexts", {d: n for d, n in self.contexts.items() if n}))
            if held}

    def _cuInit(self, flags): return ()
    def _cuDeviceGetCount(self, out=None): return (self.devices,)
    def _cuDeviceGet(self, ordinal, out=None): return (ordinal,)
    def _cuMemGetAllocationGranularity(self, prop, flags, out=None): return (GRANULARITY,)
    def _cuMemSetAccess(self, address, size, access, count): return ()
    def _cuCtxSetCurrent(self, ctx): return ()
    def _cuCtxSynchronize(self): return ()

    def _cuDevicePrimaryCtxRetain(self, device, out=None):
        self.contexts[device] = self.contexts.get(device, 0) + 1
        return (("context", device),)

    def _cuDevicePrimaryCtxRelease(self, device):
        self.contexts[device] -= 1
        return ()

    def _cuMemCreate(self, size, prop, flags, out=None):
        handle = self._new()
        self.handles.add(handle)
        return (handle,)

    def _cuMemRelease(self, handle):
        self.handles.remove(handle)
        return ()

    def _cuMemAddressReserve(self, size, alignment, address, flags, out=None):
        held = []  # host memory at a still-reserved range: the driver never gives one out twice
        while True:
            memory = ctypes.create_string_buffer(size)
            at = ctypes.addressof(memory)
            if not any(a < at + size and at < a + n for a, n in self.retired.items()):
                break
            held.append(memory)
        self.ranges[at] = memory
        return (at,)

    def _cuMemAddressFree(self, address, size):
        del self.ranges[address]
        self.retired.pop(address, None)
        return ()

    def _cuMemMap(self, address, size, offset, handle, flags):
        assert handle in self.handles
        self.mapped.add(address)
        return ()

    def _cuMemUnmap(self, address, size):
        self.mapped.remove(address)
        self.ranges[address], self.retired[address] = None, size  # the host memory goes
        return ()

    def _cuMulticastGetGranularity(self, prop, flags, out=None): return (GRANULARITY,)
    def _cuMulticastAddDevice(self, handle, device): return ()

    def _cuMulticastCreate(self, prop, out=None):
        return self._cuMemCreate(prop.size, prop, 0)

    def _cuMulticastBindMem(self, handle, offset, memory, memory_offset, size, flags):
        assert handle in self.handles and memory in self.handles
        self.bound[handle] = self.bound.get(handle, 0) + 1
        return ()

    def _cuMulticastUnbind(self, handle, device, offset, size):
        self.bound[handle] -= 1
        return ()

    def _cuMemsetD32(self, address, value, count):
        (ctypes.c_uint32 * count).from_address(address)[:] = [value] * count
        return ()

    def _cuMemcpyDtoH(self, destination, source, nbytes):
        ctypes.memmove(destination, source, nbytes)
        return ()


@pytest.fixture
def driver(monkeypatch):
    """Mailbox's driver, faked: `driver(fail_at=n)` makes (and installs) a new one."""
    def install(**kwargs):
        fake = FakeDriver(**kwargs)
        monkeypatch.setattr(mailbox_module.Driver, "__init__",
                            lambda self: setattr(self, "cu", fake))
        return fake
    return install


ORDINALS = {"two devices": [0, 1], "virtual": [0, 0, 0, 0], "multicast": [0, 1, 2, 3]}


def poke(mailbox, rank, word, value):
    ctypes.c_uint32.from_address(mailbox.addresses[rank] + mailbox.layout.word(word)).value = value


@pytest.mark.parametrize("ordinals", ORDINALS.values(), ids=ORDINALS.keys())
def test_a_failed_driver_call_leaks_nothing(driver, monkeypatch, ordinals):
    """Every driver call of the construction, made to fail in turn: a RuntimeError names it,
    and nothing it had allocated, mapped, bound or retained is left. (The multicast object
    is the stand-in's: no real one is made.)"""
    multicast = len(set(ordinals)) == 4
    for name in mailbox_module.MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    fake = driver()
    Mailbox(ordinals, MailboxLayout(len(ordinals)), multicast=multicast).close()
    assert fake.leaks() == {}
    names = fake.calls[:len(fake.calls) - fake.calls[::-1].index("cuMemsetD32")]  # to the arm
    assert {"cuMemCreate", "cuMemMap", "cuDevicePrimaryCtxRetain"} <= set(names)
    for n, name in enumerate(names, 1):
        fake = driver(fail_at=n)
        with pytest.raises(RuntimeError, match=rf"CUDA driver call {name}\("):
            Mailbox(ordinals, MailboxLayout(len(ordinals)), multicast=multicast)
        assert fake.leaks() == {}, (n, name)


def test_close_frees_everything_and_refuses_later_use(driver):
    fake = driver()
    mailbox = Mailbox([0, 1], MailboxLayout(2))
    assert mailbox.unarmed() == 0 and mailbox.calls() == [0, 0]
    mailbox.close()
    mailbox.close()
    assert fake.leaks() == {}
    for use in (mailbox.arm, mailbox.check, mailbox.calls, lambda: mailbox.read(0, 0, 4)):
        with pytest.raises(ValueError, match=r"is closed"):
            use()


@pytest.mark.parametrize("ordinals", ORDINALS.values(), ids=ORDINALS.keys())
def test_a_freed_mailbox_keeps_its_address_ranges_reserved(driver, monkeypatch, ordinals):
    """Closed, then collected: its memory is released and every range it handed out (each
    rank's buffer, the multicast mapping) stays reserved and unmapped, so a stale peer table
    can only fault (tests/test_gpu_lamport.py has the fault)."""
    for name in mailbox_module.MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    fake = driver()
    multicast = len(set(ordinals)) == 4
    mailbox = Mailbox(ordinals, MailboxLayout(len(ordinals)), multicast=multicast)
    table = mailbox.peer_table.copy()
    addresses = {int(a) for a in table.view(np.uint64).ravel() if a}
    assert len(addresses) == len(ordinals) + multicast
    mailbox.close()
    del mailbox
    gc.collect()
    assert fake.leaks() == {} and "cuMemAddressFree" not in fake.calls
    assert set(fake.retired) == addresses and not fake.mapped & addresses


def test_a_collected_mailbox_waits_for_its_devices_before_freeing(driver):
    """A mailbox dropped without close: its devices go idle before its memory is unmapped
    (a kernel may still use it), and its contexts are released."""
    fake = driver()
    mailbox = Mailbox([0, 1], MailboxLayout(2))
    del fake.calls[:], mailbox
    gc.collect()
    assert fake.leaks() == {}
    assert "cuCtxSynchronize" in fake.calls
    assert fake.calls.index("cuCtxSynchronize") < fake.calls.index("cuMemUnmap")


def test_a_closed_then_collected_mailbox_releases_nothing_twice(driver):
    fake = driver()
    Mailbox([0, 1], MailboxLayout(2)).close()
    gc.collect()
    assert fake.leaks() == {} and all(n == 0 for n in fake.contexts.values())


@pytest.mark.parametrize("args,pattern", [
    ((-1, 0, 4), r"rank=-1 must be in \[0, 1\]"),
    ((2, 0, 4), r"rank=2 must be in \[0, 1\]"),
    ((0, -4, 4), r"offset=-4 must be in \[0, "),
    ((0, 0, 6), r"nbytes=6 must be a multiple of 4"),
    ((0, "end", 4), r"nbytes=4 must be in \[0, 0\]"),
    ((0, "end", 0), None),
])
def test_read_refuses_what_is_outside_the_buffer(driver, args, pattern):
    driver()
    with Mailbox([0, 1], MailboxLayout(2)) as mailbox:
        end = allocated(mailbox.layout)
        rank, offset, nbytes = (end if a == "end" else a for a in args)
        if pattern is None:
            assert mailbox.read(rank, offset, nbytes).size == 0
            return
        with pytest.raises(ValueError, match=pattern):
            mailbox.read(rank, offset, nbytes)


@pytest.mark.parametrize("calls, reported", [(0x80000005, "2147483654"),
                                              (0xFFFFFFFF, "4294967296")])
def test_check_reports_calls_past_two_to_the_31(driver, calls, reported):
    """The control words are unsigned: a call number past 2³¹ is reported as it is, and so is
    the 2³²-th call (CALLS = 2³² − 1 at its start)."""
    driver()
    with Mailbox([0, 1], MailboxLayout(2)) as mailbox:
        poke(mailbox, 0, CONTROL.CALLS, calls)
        assert mailbox.calls() == [calls, 0]
        for word, value in ((CONTROL.TIMED_OUT, calls), (CONTROL.FAILED, 1),
                            (CONTROL.MISSING, 0b10), (CONTROL.WAITER, 1)):
            poke(mailbox, 0, word, value)
        assert mailbox.timed_out() == [0]
        with pytest.raises(TimeoutError, match=rf"rank 0 \(all-reduce consumer\) gave up in "
                                               rf"call {reported} since arm\(\) waiting for rows "
                                               rf"of rank\(s\) \[1\]"):
            mailbox.check()
        mailbox.arm()
        assert mailbox.calls() == [0, 0] and mailbox.unarmed() == 0
        assert mailbox.read(1, 0, 8).tolist() == [SENTINEL, SENTINEL]


def test_a_failure_before_the_allocation_tells_the_group(driver, monkeypatch):
    """A process of a multi-process group whose driver fails at once still tells the others
    (they would otherwise wait out the exchange's timeout)."""
    told = []
    monkeypatch.setattr(mailbox_module.handles, "abandon", lambda group, why: told.append(why))
    group = types.SimpleNamespace(owns=lambda rank: rank == 0)
    driver(fail_at=1)
    with pytest.raises(RuntimeError, match=r"Mailbox needs CUDA GPUs"):
        Mailbox([0, None], MailboxLayout(2), group=group)
    assert told and told[0].startswith("making the mailbox: RuntimeError: Mailbox needs CUDA")


def test_a_closed_mesh_mailbox_refuses_its_calls(driver):
    """MeshMailbox.check() after close raises, rather than reporting no failure."""
    driver()
    box = object.__new__(k3.MeshMailbox)  # one group on the stand-in driver, as __init__ makes
    box.mesh, box.axis_name = Mesh(np.array(jax.devices()[:2]), ("tp",)), "tp"
    box.spec = MailboxSpec(MailboxLayout(2))
    box._groups = {0: Mailbox([0, 1], MailboxLayout(2))}
    poke(box._groups[0], 1, CONTROL.FAILED, 1)
    with pytest.raises(TimeoutError, match=r"group 0: .*marked failed"):
        box.check()
    box.close()
    for use in (box.check, box.arm, box.calls):
        with pytest.raises(ValueError, match=r"MeshMailbox\.\w+: mailbox=MeshMailbox\(.* closed"):
            use()
