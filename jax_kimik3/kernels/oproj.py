"""The post-attention tail on kernels: o_proj, its Lamport all-reduce, and AttnRes, for R ranks
per call (a mesh rank: R = 1, its index from `axis_index`; virtual TP: every rank on one GPU).

Three variants, chosen per (B, K per rank) by `tuning.tail_variant`, each ONE custom call:
- "split" (kernels/tail.py): 1. the producer kernel (kernels/producer.py) computes each rank's
  o_proj rows bf16(x @ w.T) and publishes them into slot `rank` of every rank's mailbox
  (one-shot), or each column chunk into its owner's receive slot (two-shot);
  2. two-shot only, the owner kernel (kernels/lamport.py): sums its chunk's T receive slots
  and sends the sum into every rank's gather region;
  3. the AttnRes kernel with a mailbox reduction (kernels/attn_res.py) polls each rank's T
  slots (two-shot: its gather region), sums them in rank order, re-arms them and runs the
  post-attention AttnRes; with `ahead` weights it also stores the saved blocks' statistics
  for the next call site; its last CTA advances the call counters.
- "xla": as "split", but XLA's dot makes the rows and the Lamport publish kernel does step 1.
- "fused" (kernels/fused.py): steps 1 and 3 in one persistent launch whose grid is every
  co-resident cluster (kernels/residency.py): each CTA first does its share of the R·N/16
  producer CTAs, then each cluster its share of the R·B consumer rows, so no wait depends on
  the hardware's block dispatch order. One-shot without `ahead`: a two-shot or `ahead` tail
  where the table says "fused" runs "split". `two_shot=None` takes `tuning.use_two_shot`.
The buffer of every call is its ranks' call counter % 2 (docs/protocol.md): no argument here
picks it, so consecutive calls on a mailbox alternate whatever the layers.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax

from jax_kimik3 import reference, tuning
from jax_kimik3.kernels import attn_res_ops, residency
from jax_kimik3.kernels.variants import AttnResVariant, Reduction, tiles
from jax_kimik3.kernels.geometry import CLUSTER, FUSED_CTAS_PER_SM, PRODUCER_WARPS, WARP
from jax_kimik3.kernels.lamport_ops import kernel_spec
from jax_kimik3.kernels.launch import Signature, Variant
from jax_kimik3.layout import MailboxSpec


TAIL = Signature(  # kernels/tail.py: Tail (rows from the producer: x, w; from XLA's dot: rows)
    inputs=("x", "w", "rows", "prefix", "blocks", "res_norm_w", "res_proj_w", "out_norm_w",
            "ahead_norm_w", "ahead_proj_w", "table", "ranks"),
    outputs=attn_res_ops.SIGNATURE.outputs)
FUSED = Signature(  # kernels/fused.py: OprojAttnResFused
    inputs=("x", "w", "prefix", "blocks", "res_norm_w", "res_proj_w", "out_norm_w", "table",
            "ranks"),
    outputs=("out", "new_prefix"))


class TailChoice(NamedTuple):
    """What one tail call launches: its variant, all-reduce and the static parameters its
    kernels are compiled for (batches with one TailChoice share one compiled call)."""

    variant: tuning.TailVariant
    two_shot: bool
    tiles: int | None = None  # split: the producer's B tiles (it reads the batch at run time)
    batch: int | None = None  # fused: the batch it is compiled for (split and xla read it)


def choose(batch, k, tp, ahead: bool, *, variant=None, two_shot=None) -> TailChoice:
    """What the tail of `batch` rows at K = `k` per rank, `tp` ranks and (`ahead`) statistics
    ahead launches: `variant` and `two_shot` as asked for, else the tables'. The fused kernel
    is one-shot without statistics ahead: asked for, it runs one-shot; the table's fused runs
    split where two-shot or ahead is asked for or tabled. `batch` may be symbolic where every
    decision is (a batch range inside one table region and one producer B tile count)."""
    if variant is not None and variant not in tuning.TAIL_VARIANT_NAMES:
        raise ValueError(f"variant={variant!r} must be one of {tuning.TAIL_VARIANT_NAMES}")
    if variant == "fused":
        if two_shot or ahead:
            raise NotImplementedError(f"the fused tail is one-shot without ahead; got "
                                      f"{two_shot=}, {ahead=}")
        return TailChoice("fused", False, batch=operator.index(batch))
    if two_shot is None:
        two_shot = tuning.use_two_shot(batch, tp)
    chosen = variant or tuning.tail_variant(batch, k)
    if chosen == "fused" and (two_shot or ahead):
        chosen = "split"
    if chosen == "fused":
        return TailChoice("fused", False, batch=operator.index(batch))
    return TailChoice(chosen, two_shot, tiles(batch) if chosen == "split" else None)


def tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, ranks,
         spec: MailboxSpec, num_blocks, has_delta, eps, out_eps, ahead=None, two_shot=None,
         variant=None, into=None):
    """R ranks' post-attention tails through the mailbox of `spec` (peer table `table`):
    x [R, B, K], w [R, H, K] the ranks' shards, `ranks` int32 [R] their indices; prefix,
    blocks and the weights are shared. Returns each rank's (out [R, B, H], new_prefix
    [R, B, H]), and with `ahead` (a later site's res_norm_w, res_proj_w) the saved blocks'
    statistics (mixture [R, B, H], scal [R, B, 2]). `variant`: "fused", "split" or "xla";
    None: `tuning.tail_variant`. `into` = (out, new_prefix) [R·B, H] buffers written in place
    (the GPU tests pass poisoned ones)."""
    _, b, k = x.shape
    return launch_tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table=table,
                       ranks=ranks, spec=spec, num_blocks=num_blocks, has_delta=has_delta,
                       eps=eps, out_eps=out_eps, ahead=ahead,
                       choice=choose(b, k, spec.tp, ahead is not None, variant=variant,
                                     two_shot=two_shot),
                       into=into)


def launch_tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, table, ranks,
                spec: MailboxSpec, num_blocks, has_delta, eps, out_eps, ahead,
                choice: TailChoice, into=None):
    """`tail` as `choice` says: the one custom call. Split and xla read the batch at run time
    (B may be symbolic, as the kernel library's build traces it); the fused kernel is
    compiled for `choice.batch`."""
    r, b, k = x.shape
    variant, two_shot = choice.variant, choice.two_shot
    h = prefix.shape[1]
    attn_res = AttnResVariant(num_blocks=num_blocks, has_delta=has_delta, write_idx=-1,
                              out_norm=out_norm_w is not None, precomputed=False,
                              eps=float(eps), out_eps=float(out_eps),
                              reduction=Reduction(kernel_spec(spec), r, two_shot),
                              ahead=ahead is not None)
    ahead_norm_w, ahead_proj_w = ahead or (None, None)
    inputs = dict(prefix=prefix, blocks=blocks, res_norm_w=res_norm_w, res_proj_w=res_proj_w,
                  out_norm_w=out_norm_w, table=table, ranks=ranks)
    stacked = dict(x=x.reshape(r * b, k), w=w.reshape(r * h, k))
    if variant == "fused":
        # The fused kernel's shared memory leaves FUSED_CTAS_PER_SM per SM (kernels/fused.py).
        clusters = residency.clusters_here(CLUSTER, PRODUCER_WARPS * WARP, 0, FUSED_CTAS_PER_SM)
        signature, call = FUSED, Variant("fused", (choice.batch, k, attn_res, clusters))
        inputs.update(stacked)
    else:
        inputs.update(ahead_norm_w=ahead_norm_w, ahead_proj_w=ahead_proj_w)
        if variant == "split":
            inputs.update(stacked)
            call = Variant("tail", (choice.tiles, k, attn_res))
        else:  # "xla": XLA's dot makes each rank's rows
            inputs["rows"] = jax.vmap(reference.oproj_partial)(x, w).reshape(r * b, h)
            call = Variant("tail", (None, None, attn_res))
        signature = TAIL
    values = signature.call(call, inputs, attn_res_ops.outputs(attn_res, b, h),
                            into=attn_res_ops.into_outputs(into))
    out, new_prefix = (values[name].reshape(r, b, h) for name in ("out", "new_prefix"))
    if ahead is None:
        return out, new_prefix
    return out, new_prefix, (values["ahead_mixture"].reshape(r, b, h),
                             values["ahead_scal"].reshape(r, b, 2))
