"""Block AttnRes and its statistics as kernel calls inside jax.jit (kernels/attn_res.py has the
kernels); this module imports no part of the CuTe DSL."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kimik3 import reference
from jax_kimik3.kernels.launch import Variant, launch
from jax_kimik3.layout import MailboxSpec


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The all-reduce an AttnRes kernel completes, as its delta or (starting a block) its
    prefix: the sum of the rows that `ranks` ranks published into the mailbox of `spec` (the
    gather region after the `two_shot` owners)."""

    spec: MailboxSpec
    ranks: int = 1
    two_shot: bool = False


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


def outputs(variant: AttnResVariant, batch: int, hidden: int) -> list:
    """The kernel's results, in order: out, [new_prefix], [mixture, scal] (ahead), each with
    R·B rows; the block write (an alias of `blocks`) comes after them."""
    rows = variant.ranks * batch
    row = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    results = [row] * (1 + variant.stores_prefix)
    if variant.ahead:
        results += [jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
                    jax.ShapeDtypeStruct((rows, 2), jnp.float32)]
    return results


def results(variant: AttnResVariant, values, prefix, blocks):
    """(out, new_prefix, new_blocks[, (mixture, scal)]) from the kernel's result list."""
    out = values[0]
    new_prefix = values[1] if variant.stores_prefix else prefix
    new_blocks = values[-1] if variant.write_idx >= 0 else blocks
    if variant.ahead:
        return out, new_prefix, new_blocks, (values[2], values[3])
    return out, new_prefix, new_blocks


def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta, write_idx,
             eps, out_eps, stats, ahead=None, into=None):
    """The kernel behind `jax_kimik3.attn_res` (same arguments and results; inputs checked;
    `stats` a (mixture, scal) pair). `ahead` = (res_norm_w, res_proj_w) of a later call site
    over the same saved blocks: their statistics (mixture, scal) come back as a fourth result.
    `into` = (out, new_prefix[, mixture, scal]) buffers written in place (the GPU tests pass
    poisoned ones)."""
    variant = AttnResVariant(num_blocks, delta is not None, write_idx, out_norm_w is not None,
                             stats is not None, float(eps), float(out_eps),
                             ahead=ahead is not None)
    mixture, scal = (None, None) if stats is None else stats
    results_ = outputs(variant, *prefix.shape)
    inputs = [prefix, delta, blocks, mixture, scal, res_norm_w, res_proj_w, out_norm_w,
              *(ahead or (None, None)), None, None]
    aliases = {}
    if write_idx >= 0:  # the block write updates `blocks` in place
        aliases[2] = len(results_)
        results_.append(jax.ShapeDtypeStruct(blocks.shape, blocks.dtype))
    if into is not None:
        for buffer, index in zip(into, range(len(results_) - (write_idx >= 0))):
            aliases[len(inputs)] = index
            inputs.append(buffer)
    values = launch(Variant("attn_res", (variant,)), tuple(results_), aliases)(*inputs)
    return results(variant, values, prefix, blocks)


def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps, into=None):
    """The kernel behind `jax_kimik3.attn_res_statistics`; `into` = poisoned (mixture, scal)."""
    if num_blocks == 0:  # nothing to reduce: the empty softmax's constants
        return reference.attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=0, eps=eps)
    b, _, h = blocks.shape
    outputs_ = (jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((b, 2), jnp.float32))
    inputs = [blocks, res_norm_w, res_proj_w]
    aliases = {}
    if into is not None:
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
        inputs += list(into)
    return launch(Variant("statistics", (num_blocks, float(eps))), outputs_, aliases)(*inputs)
