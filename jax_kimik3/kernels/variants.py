"""What a compiled kernel is specialised for: the static parameters that kernel objects are
built from and the `*_ops` calls pass. Pure: imports no part of the DSL and no dispatch, so
what the kernels import (the library's digest covers it) stays the kernels' own."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels.geometry import TOKENS
from jax_kimik3.layout import MailboxSpec


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The all-reduce an AttnRes kernel completes, as its delta or (starting a block) its
    prefix: the sum of the rows that `ranks` ranks published into the mailbox of `spec` (the
    gather region after the `two_shot` owners)."""

    spec: MailboxSpec
    ranks: int = 1
    two_shot: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttnResVariant:
    """What one compiled AttnRes kernel does (all static)."""

    num_blocks: int
    has_delta: bool
    write_idx: int  # -1: no block write
    out_norm: bool
    precomputed: bool  # read (mixture, scal) instead of the saved blocks
    eps: float
    out_eps: float
    reduction: Reduction | None = None
    ahead: bool = False  # also store the saved blocks' statistics under a later site's weights

    def __post_init__(self):
        if self.ahead and (self.precomputed or not self.stores_prefix):
            raise ValueError("statistics ahead need the saved blocks (no stats=) and a delta "
                             "or a reduction (the kernel's outputs are out, new_prefix, "
                             "statistics)")
        if self.reduction is not None and (self.precomputed or self.write_idx >= 0):
            raise ValueError("an AttnRes kernel that completes an all-reduce (the "
                             "post-attention tail) reads the saved blocks and writes none")

    @property
    def stores_prefix(self) -> bool:
        """A new prefix differs from the input prefix: a delta, or a block from the mailbox."""
        return self.has_delta or self.reduction is not None

    @property
    def sources(self) -> int:
        """Sources reduced over the cluster: the saved blocks (unless precomputed) and p."""
        return 1 if self.precomputed else self.num_blocks + 1

    @property
    def ranks(self) -> int:
        return 1 if self.reduction is None else self.reduction.ranks


def tiles(batch) -> int:
    """B tiles of TOKENS tokens that hold `batch` rows: what the producer is compiled for (it
    reads the batch itself at run time). By comparisons only, so a symbolic batch whose range
    lies within one tile count has it too (else jax raises: the range is too wide)."""
    capacity = KIMI_K3.mailbox_capacity
    if not 1 <= batch <= capacity:
        raise ValueError(f"o_proj producer: B={batch} must be in [1, {capacity}]")
    return next(t for t in range(1, capacity // TOKENS + 1) if batch <= t * TOKENS)


class Publish(NamedTuple):
    """Where a producer's rows go: the mailbox of `spec` (one-shot slots or two-shot owners)."""

    spec: MailboxSpec
    two_shot: bool
