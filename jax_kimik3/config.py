"""Kimi K3 sizes and the per-layer plan of the attention tail; imports nothing of the package."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

CallSiteName = Literal["pre_attention", "post_attention", "final"]


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One Block AttnRes call: its weights (checkpoint names), K saved blocks, delta and block write.

    `num_blocks` saved blocks are mixed with the prefix; `has_delta` adds a delta to the
    prefix first (without it the prefix is the call's input, e.g. a new block's attn_out);
    `write_idx` >= 0 stores the updated prefix to `blocks[:, write_idx]` before the mix.
    """

    name: CallSiteName
    res_norm: str
    res_proj: str
    out_norm: str
    num_blocks: int
    has_delta: bool
    write_idx: int = -1


def check_int(name, value, low, high=None) -> int:
    """`value` as an int in [low, high]; a ValueError names it otherwise (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value} must be {bound}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What decoder layer `index` does at decode time (docs/model.md)."""

    index: int
    is_block_write_layer: bool
    block_write_idx: int
    prev_valid_blocks: int
    is_mla: bool
    pre_attention: CallSite
    post_attention: CallSite


@dataclasses.dataclass(frozen=True)
class KimiK3Config:
    """Kimi K3 model facts used by the attention tail."""

    hidden_size: int = 7168
    num_layers: int = 93
    attn_res_block_size: int = 12
    o_proj_in_features: int = 12288
    rms_norm_eps: float = 1e-5
    mla_period: int = 4  # MLA at layers p-1, 2p-1, ... and the last layer; KDA elsewhere
    mailbox_capacity: int = 64  # decode token rows per rank

    def __post_init__(self):
        for field in ("hidden_size", "num_layers", "attn_res_block_size", "o_proj_in_features",
                      "mla_period", "mailbox_capacity"):
            check_int(field, getattr(self, field), 1)
        eps = self.rms_norm_eps
        if (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps)
                or not eps > 0):
            raise ValueError(f"rms_norm_eps={eps!r} must be a finite number > 0")

    @property
    def num_attn_res_blocks(self) -> int:
        """Saved blocks after the last layer: ceil(num_layers / attn_res_block_size)."""
        return math.ceil(self.num_layers / self.attn_res_block_size)

    def o_proj_local_features(self, tp: int, name: str = "tp") -> int:
        """K of one rank's o_proj shard at tensor parallelism `tp` (the argument `name`)."""
        check_int(name, tp, 1)
        if self.o_proj_in_features % tp:
            raise ValueError(f"{name}={tp} must divide o_proj_in_features="
                             f"{self.o_proj_in_features}")
        return self.o_proj_in_features // tp

    def layer(self, index: int) -> LayerPlan:
        """The plan of decoder layer `index` (0-based)."""
        index = check_int("layer index", index, 0, self.num_layers - 1)
        size = self.attn_res_block_size
        write = index % size == 0
        write_idx = index // size if write else -1
        prev_valid = math.ceil(index / size)
        pre = CallSite(
            "pre_attention", "self_attention_res_norm", "self_attention_res_proj",
            "input_layernorm", num_blocks=prev_valid, has_delta=index > 0, write_idx=write_idx)
        post = CallSite(
            "post_attention", "mlp_res_norm", "mlp_res_proj", "post_attention_layernorm",
            num_blocks=prev_valid + write, has_delta=not write)
        is_mla = index % self.mla_period == self.mla_period - 1 or index == self.num_layers - 1
        return LayerPlan(index, write, write_idx, prev_valid, is_mla, pre, post)

    def layers(self) -> tuple[LayerPlan, ...]:
        """Every decoder layer's plan, in order."""
        return tuple(self.layer(i) for i in range(self.num_layers))

    def final(self, num_layers: int | None = None) -> CallSite:
        """The AttnRes after the last layer (after `num_layers` layers; all of them by default)."""
        n = self.num_layers if num_layers is None else check_int("num_layers", num_layers, 1,
                                                                  self.num_layers)
        blocks = math.ceil(n / self.attn_res_block_size)
        return CallSite("final", "output_attn_res_norm", "output_attn_res_proj", "norm",
                        num_blocks=blocks, has_delta=True)


KIMI_K3 = KimiK3Config()
