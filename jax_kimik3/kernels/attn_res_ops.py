"""Block AttnRes and its statistics as kernel calls inside jax.jit (kernels/attn_res.py has the
kernels); this module imports no part of the CuTe DSL."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_kimik3 import reference
from jax_kimik3.kernels.launch import Variant, launch
from jax_kimik3.mailbox import MailboxLayout


@dataclasses.dataclass(frozen=True)
class AttnResVariant:
    """What one compiled AttnRes kernel does (all static)."""

    num_blocks: int
    has_delta: bool
    write_idx: int  # -1: no block write
    out_norm: bool
    precomputed: bool  # read (mixture, scal) instead of the saved blocks
    eps: float
    out_eps: float
    ring: MailboxLayout | None = None  # the delta is the all-reduce of these mailbox slots
    parity: int = 0
    max_spins: int = 0
    two_shot: bool = False  # the ring's sum waits in the gather region (two-shot owners)
    ahead: bool = False  # also store the saved blocks' statistics under a later site's weights

    def __post_init__(self):
        if self.ahead and (self.precomputed or not self.stores_prefix):
            raise ValueError("statistics ahead need the saved blocks (no stats=) and a delta "
                             "or a ring (the kernel's outputs are out, new_prefix, statistics)")

    @property
    def stores_prefix(self) -> bool:
        """A new prefix differs from the input prefix: a delta, or a block from the ring."""
        return self.has_delta or self.ring is not None

    @property
    def sources(self) -> int:
        """Sources reduced over the cluster: the saved blocks (unless precomputed) and p."""
        return 1 if self.precomputed else self.num_blocks + 1


class Ring(NamedTuple):
    """A Lamport mailbox as the AttnRes input: the all-reduce of the TP ranks' rows published
    at `parity` (one-shot slots, or the gather region after the `two_shot` owners) is the
    delta (`has_delta`) or, starting a block, the new prefix itself."""

    layout: MailboxLayout
    parity: int
    max_spins: int
    two_shot: bool
    has_delta: bool
    table: Any  # uint32 [T, 2] peer table
    rank: Any  # int32 [1]
    after: Any  # an array the publishes produced: orders this kernel after them


def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta, write_idx,
             eps, out_eps, stats, ring: Ring | None = None, ahead=None, into=None):
    """The kernel behind `jax_kimik3.attn_res` (same arguments and results; inputs checked).

    `ring` takes the delta from a Lamport mailbox instead of `delta`. `ahead` = (res_norm_w,
    res_proj_w) of a later call site over the same saved blocks: the saved blocks' statistics
    under those weights (mixture, scal) come back as a fourth result. `into` = (out,
    new_prefix[, mixture, scal]) buffers written in place (the GPU tests pass poisoned ones).
    """
    has_delta = delta is not None if ring is None else ring.has_delta
    variant = AttnResVariant(num_blocks, has_delta, write_idx, out_norm_w is not None,
                             stats is not None, float(eps), float(out_eps),
                             *((None, 0, 0, False) if ring is None else ring[:4]),
                             ahead=ahead is not None)
    mixture, scal = (None, None) if stats is None else stats
    row = jax.ShapeDtypeStruct(prefix.shape, jnp.bfloat16)
    outputs = [row] * (1 + variant.stores_prefix)
    if variant.ahead:
        b, h = prefix.shape
        outputs += [jax.ShapeDtypeStruct((b, h), jnp.float32),
                    jax.ShapeDtypeStruct((b, 2), jnp.float32)]
    inputs = [prefix, delta, blocks, mixture, scal, res_norm_w, res_proj_w, out_norm_w,
              *(ahead or (None, None)), *((None,) * 3 if ring is None else ring[5:])]
    aliases = {}
    if write_idx >= 0:  # the block write updates `blocks` in place
        aliases[2] = len(outputs)
        outputs.append(jax.ShapeDtypeStruct(blocks.shape, blocks.dtype))
    if into is not None:
        for buffer, index in zip(into, range(len(outputs) - (write_idx >= 0))):
            aliases[len(inputs)] = index
            inputs.append(buffer)
    results = launch(Variant("attn_res", (variant,)), tuple(outputs), aliases)(*inputs)
    out = results[0]
    new_prefix = results[1] if variant.stores_prefix else prefix
    new_blocks = results[-1] if write_idx >= 0 else blocks
    if variant.ahead:
        return out, new_prefix, new_blocks, (results[2], results[3])
    return out, new_prefix, new_blocks


def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps, into=None):
    """The kernel behind `jax_kimik3.attn_res_statistics`; `into` = poisoned (mixture, scal)."""
    if num_blocks == 0:  # nothing to reduce: the empty softmax's constants
        return reference.attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=0, eps=eps)
    b, _, h = blocks.shape
    outputs = (jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((b, 2), jnp.float32))
    inputs = [blocks, res_norm_w, res_proj_w]
    aliases = {}
    if into is not None:
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
        inputs += list(into)
    return launch(Variant("statistics", (num_blocks, float(eps))), outputs, aliases)(*inputs)
