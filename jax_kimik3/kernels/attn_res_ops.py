"""Block AttnRes and its statistics as kernel calls inside jax.jit (kernels/attn_res.py has the
kernels); this module imports no part of the CuTe DSL."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kimik3 import reference
from jax_kimik3.kernels.launch import Signature, Variant
from jax_kimik3.kernels.variants import AttnResVariant


SIGNATURE = Signature(  # kernels/attn_res.py: AttnResKernel; the tails' consumer reads these too
    inputs=("prefix", "delta", "blocks", "mixture", "scal", "res_norm_w", "res_proj_w",
            "out_norm_w", "ahead_norm_w", "ahead_proj_w", "table", "ranks"),
    outputs=("out", "new_prefix", "ahead_mixture", "ahead_scal"))
STATISTICS = Signature(inputs=("blocks", "res_norm_w", "res_proj_w"),
                       outputs=("mixture", "scal"))  # kernels/attn_res.py: StatisticsKernel


def outputs(variant: AttnResVariant, batch: int, hidden: int) -> dict:
    """The kernel's results by name: out, [new_prefix], [ahead_mixture, ahead_scal] (ahead),
    each with R·B rows."""
    rows = variant.ranks * batch
    row = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    results = {"out": row}
    if variant.stores_prefix:
        results["new_prefix"] = row
    if variant.ahead:
        results["ahead_mixture"] = jax.ShapeDtypeStruct((rows, hidden), jnp.float32)
        results["ahead_scal"] = jax.ShapeDtypeStruct((rows, 2), jnp.float32)
    return results


def into_outputs(into) -> dict:
    """Buffers to write the first outputs into (the GPU tests pass poisoned ones), by name."""
    return dict(zip(SIGNATURE.outputs, into or ()))


def results(variant: AttnResVariant, values: dict, prefix, blocks):
    """(out, new_prefix, new_blocks[, (mixture, scal)]) from the kernel's results by name."""
    out = values["out"]
    new_prefix = values.get("new_prefix", prefix)
    new_blocks = values.get("new_blocks", blocks)
    if variant.ahead:
        return out, new_prefix, new_blocks, (values["ahead_mixture"], values["ahead_scal"])
    return out, new_prefix, new_blocks


def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta, write_idx,
             eps, out_eps, stats, ahead=None, into=None):
    """The kernel behind `jax_kimik3.attn_res` (same arguments and results; inputs checked;
    `stats` a (mixture, scal) pair). `ahead` = (res_norm_w, res_proj_w) of a later call site
    over the same saved blocks: their statistics (mixture, scal) come back as a fourth result.
    `into` = (out, new_prefix[, mixture, scal]) buffers written in place (the GPU tests pass
    poisoned ones)."""
    variant = AttnResVariant(num_blocks=num_blocks, has_delta=delta is not None,
                             write_idx=write_idx, out_norm=out_norm_w is not None,
                             precomputed=stats is not None, eps=float(eps),
                             out_eps=float(out_eps), ahead=ahead is not None)
    mixture, scal = (None, None) if stats is None else stats
    ahead_norm_w, ahead_proj_w = ahead or (None, None)
    inputs = dict(prefix=prefix, delta=delta, blocks=blocks, mixture=mixture, scal=scal,
                  res_norm_w=res_norm_w, res_proj_w=res_proj_w, out_norm_w=out_norm_w,
                  ahead_norm_w=ahead_norm_w, ahead_proj_w=ahead_proj_w)
    values = SIGNATURE.call(Variant("attn_res", (variant,)), inputs,
                            outputs(variant, *prefix.shape), into=into_outputs(into),
                            updates={"blocks": "new_blocks"} if write_idx >= 0 else None)
    return results(variant, values, prefix, blocks)


def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps, into=None):
    """The kernel behind `jax_kimik3.attn_res_statistics`; `into` = poisoned (mixture, scal)."""
    if num_blocks == 0:  # nothing to reduce: the empty softmax's constants
        return reference.attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=0, eps=eps)
    b, _, h = blocks.shape
    produce = {"mixture": jax.ShapeDtypeStruct((b, h), jnp.float32),
               "scal": jax.ShapeDtypeStruct((b, 2), jnp.float32)}
    values = STATISTICS.call(Variant("statistics", (num_blocks, float(eps))),
                             dict(blocks=blocks, res_norm_w=res_norm_w, res_proj_w=res_proj_w),
                             produce, into=dict(zip(STATISTICS.outputs, into or ())))
    return values["mixture"], values["scal"]
