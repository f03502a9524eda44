"""The mailbox's layout, shared by the host (jax_kimik3.mailbox allocates and arms it) and the
kernels (they address it): byte offsets, the sentinel, the control words, the peer table's
format, the wait bound. Pure arithmetic: imports no CUDA binding and no part of the DSL.

A rank's buffer at these byte offsets (T = TP, C = capacity rows, H = hidden; bf16 unless said):

| region | shape | bytes |
|---|---|---|
| one-shot slots | [2 buffers, T ranks, C, H] | 2·T·C·H·2 |
| two-shot receive | [2, T ranks, C, H/T] (chunk `rank` of each peer's rows) | 2·C·H·2 |
| two-shot gather | [2, C, H] (every owner's reduced chunk) | 2·C·H·2 |
| control | 32-bit words (CONTROL): the call counter, the failure record | 32 |

rounded up to the allocation granularity. Every bf16 region is armed with the 32-bit word
SENTINEL; the control words start at 0. Which of the two buffers a call uses is `calls % 2`,
from the rank's own call counter (CONTROL.CALLS). The peer table, an ordinary JAX input, is
uint32 [T + 1, 2]: (low, high) words of each rank's buffer address, then of the multicast
address (0 without one). docs/protocol.md has the protocol.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from jax_kimik3.config import KIMI_K3, check_int
from jax_kimik3.kernels.geometry import VECTOR

SENTINEL = 0x80000000  # fp32 -0: a mailbox word no producer can publish (bf16 -0 becomes +0)
BUFFERS = 2  # slot buffers; a call uses buffer `calls % 2` (docs/protocol.md: why two suffice)
DEFAULT_TIMEOUT_MS = 10_000.0  # a wait gives up after this long (Mailbox(timeout_ms=...))
MAX_TIMEOUT_MS = 600_000.0  # ten minutes: a longer bound is no bound
MIN_TIMEOUT_MS = 0.001  # one µs, ten poll pauses: a shorter bound is none (it rounds to 0 ns)
MAX_TP = 32  # ranks per mailbox: CONTROL.MISSING holds one bit per rank
POLL_PAUSE_NS = 100  # a poller sleeps this long before each re-poll, leaving the SM to others
_ALIGN = 256


class CONTROL:
    """Indices of the 32-bit control words of a rank's buffer (at MailboxLayout.control)."""

    CALLS = 0  # all-reduces this rank has completed since arm(): the next uses buffer CALLS % 2
    FAILED = 1  # nonzero: a rank's wait gave up; every kernel on the mailbox writes NaN, waits not
    TIMED_OUT = 2  # CALLS at the start of the call in which this rank's own wait gave up
    MISSING = 3  # bit q: this rank's wait gave up on rows of rank q (0: it never gave up)
    WAITER = 4  # which kernel gave up (WAITERS)
    ARRIVALS = 5  # CTAs of the running call's last kernel done with CALLS (the last advances it)
    WORDS = 8


class WAITER:
    """Codes of the kernel whose wait gave up (CONTROL.WAITER), for the failure record."""

    CONSUMER = 1  # the all-reduce consumer (kernels/lamport.py)
    OWNER = 2  # the two-shot owner (kernels/lamport.py)
    TAIL_CONSUMER = 3  # the AttnRes kernel that completes a tail's all-reduce (kernels/attn_res.py)


WAITERS = {WAITER.CONSUMER: "all-reduce consumer", WAITER.OWNER: "two-shot owner",
           WAITER.TAIL_CONSUMER: "AttnRes tail consumer"}


def align(n, to=_ALIGN):
    """`n` rounded up to a multiple of `to`."""
    return (n + to - 1) // to * to


def check_timeout_ms(value, name="timeout_ms") -> float:
    """A wait's bound in ms (the argument `name`): a finite number in [MIN_TIMEOUT_MS,
    MAX_TIMEOUT_MS]."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or not MIN_TIMEOUT_MS <= value <= MAX_TIMEOUT_MS):
        raise ValueError(f"{name}={value!r} must be a number in [{MIN_TIMEOUT_MS:g}, "
                         f"{MAX_TIMEOUT_MS:g}] (milliseconds a wait may last before it gives up)")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MailboxLayout:
    """Byte offsets inside one rank's buffer (see the module docstring); pure arithmetic.
    `buffer` may be a traced device integer: the kernels pass `calls % 2`. The TP decides the
    layout: its rows (`capacity`) and their width (`hidden`) are the model's, so a step
    compiled for a MailboxSpec and the live mailbox whose peer table it is given (whose shape
    is the TP's) cannot disagree on where anything lies."""

    tp: int

    def __post_init__(self):
        check_int("tp", self.tp, 1, MAX_TP)  # one bit per rank in CONTROL.MISSING
        if self.hidden % (VECTOR * self.tp):
            raise ValueError(f"tp={self.tp} must be >= 1 and divide hidden={self.hidden} into "
                             f"whole {VECTOR}-element vectors")

    @property
    def capacity(self) -> int:
        """Rows per slot: the most decode rows a rank's call may carry."""
        return KIMI_K3.mailbox_capacity

    @property
    def hidden(self) -> int:
        """Columns per row: the model's H."""
        return KIMI_K3.hidden_size

    @property
    def row_bytes(self) -> int:
        return self.hidden * 2

    @property
    def chunk(self) -> int:
        """Columns of the two-shot chunk each rank owns: H / TP."""
        return self.hidden // self.tp

    def slot(self, buffer, rank, row=0):
        """Row `row` of the one-shot slot that rank `rank` publishes into, in `buffer`."""
        return ((buffer * self.tp + rank) * self.capacity + row) * self.row_bytes

    @property
    def one_shot_bytes(self) -> int:
        return BUFFERS * self.tp * self.capacity * self.row_bytes

    def receive(self, buffer, rank, row=0):
        """Row `row` of the two-shot receive slot of sending rank `rank`: H/T columns."""
        chunk_bytes = self.chunk * 2
        return self.one_shot_bytes + ((buffer * self.tp + rank) * self.capacity + row) * chunk_bytes

    def gather(self, buffer, row=0):
        """Row `row` of the two-shot gather region of `buffer`."""
        return self.one_shot_bytes + BUFFERS * self.capacity * self.row_bytes + (
            buffer * self.capacity + row) * self.row_bytes

    @property
    def armed_bytes(self) -> int:
        """The sentinel-armed prefix of the buffer: every bf16 region."""
        return self.gather(BUFFERS)

    @property
    def control(self) -> int:
        """Byte offset of the control words (CONTROL)."""
        return align(self.armed_bytes)

    def word(self, index) -> int:
        """Byte offset of control word `index` (a CONTROL attribute)."""
        return self.control + 4 * index

    @property
    def nbytes(self) -> int:
        return self.control + _ALIGN


@dataclasses.dataclass(frozen=True)
class MailboxSpec:
    """What a traced step needs to know of a mailbox, without its memory: the layout, whether
    it is multicast, and how long a wait may last. With it, the peer table travels as an
    operand (`peer_table=`), so a compiled or exported step is not tied to one process's
    buffer addresses. `virtual`: every rank's buffer on one device (no mesh can use it).
    `groups`: how many TP groups of a mesh it serves, each with its own buffers and its own
    peer table (a MeshMailbox: one group per index of the mesh's other axes)."""

    layout: MailboxLayout
    multicast: bool = False
    timeout_ms: float = DEFAULT_TIMEOUT_MS
    virtual: bool = False
    groups: int = 1

    def __post_init__(self):
        if not isinstance(self.layout, MailboxLayout):
            raise ValueError(f"layout={self.layout!r} must be a MailboxLayout")
        for name in ("multicast", "virtual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        object.__setattr__(self, "timeout_ms", check_timeout_ms(self.timeout_ms))
        check_int("groups", self.groups, 1)
        if self.virtual and self.groups > 1:
            raise ValueError(f"groups={self.groups}: a virtual mailbox (every rank on one "
                             "device) serves one group")

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_ms * 1e6)

    @property
    def spec(self) -> MailboxSpec:
        return self


def peer_table(addresses, multicast=0) -> np.ndarray:
    """uint32 [T + 1, 2]: each rank buffer's address, then the multicast address (0: none),
    as (low, high) 32-bit words."""
    words = np.asarray([*addresses, multicast], np.uint64).view(np.uint32)
    return words.reshape(len(addresses) + 1, 2)
