"""One decoder layer's attention tail with its plan bound, for decode loops in jax.jit +
shard_map: the pre-attention AttnRes, the post-attention tail (o_proj, all-reduce, AttnRes)
and, after the last layer, the final AttnRes. The plan (config.LayerPlan) supplies each call
site's saved-block count, delta and block write; weights are operands. (Which mailbox buffer
a tail uses is the mailbox's business: its call counter, not the layer.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from jax_kimik3 import api
from jax_kimik3.backend import Backend
from jax_kimik3.config import KIMI_K3, LayerPlan
from jax_kimik3.tuning import TailVariant
from jax_kimik3.validation import (Checker, check_backend_name, check_mailbox_kind,
                                   check_variant)


class AttnResWeights(NamedTuple):
    """One call site's weights [H] bf16: `*_res_norm`, `*_res_proj` and the next sublayer's
    norm (None: the call returns the mix). A pytree."""

    res_norm_w: Any
    res_proj_w: Any
    out_norm_w: Any


# Exported steps (jax_kimik3.export) keep their argument pytrees: name this one for them.
jax.export.register_namedtuple_serialization(AttnResWeights,
                                             serialized_name="jax_kimik3.AttnResWeights")


def _weights(where, weights, name="weights"):
    """`weights` must be the call site's AttnResWeights."""
    if not isinstance(weights, AttnResWeights):
        raise ValueError(f"{where}: {name}={weights!r:.60} must be an AttnResWeights "
                         "(res_norm_w, res_proj_w, out_norm_w)")
    return weights


def _delta(site, delta):
    if (delta is not None) != site.has_delta:
        raise ValueError(f"{site.name}: delta={'None' if delta is None else 'an array'}, but "
                         f"the plan says has_delta={site.has_delta}")
    return delta


@dataclasses.dataclass(frozen=True)
class AttentionTail:
    """Decoder layer `plan.index`'s tail. `mailbox` (a Mailbox; a MeshMailbox or a MailboxSpec,
    each with the peer table passed at call time) runs the all-reduce through peer mailboxes
    on the kernels; None runs XLA's psum. `two_shot` and `variant` override the measured table
    for the post-attention tail, as in `oproj_attn_res`. Hashable: pass it as a static argument."""

    plan: LayerPlan
    axis_name: str = "tp"
    mailbox: Any = None
    backend: Backend = "auto"
    two_shot: bool | None = None
    variant: TailVariant | None = None

    def __post_init__(self):
        check = Checker("AttentionTail")
        if not isinstance(self.plan, LayerPlan):
            check.fail(f"plan={self.plan!r} must be a LayerPlan (KIMI_K3.layer(i))")
        elif not (isinstance(self.plan.index, int)  # the final AttnRes, every epsilon: K3's
                  and 0 <= self.plan.index < KIMI_K3.num_layers
                  and KIMI_K3.layer(self.plan.index) == self.plan):
            check.fail(f"plan (layer index={self.plan.index!r}) is not one of Kimi K3's layer "
                       "plans: pass KIMI_K3.layer(i)")
        check.hashable(axis_name=self.axis_name)
        if self.mailbox is not None:
            check_mailbox_kind(check, self.mailbox)
        check_backend_name(check, self.backend)  # the host is checked at call time
        check_variant(check, self.variant, self.two_shot)
        check.done()

    def pre_attention(self, weights: AttnResWeights, prefix, blocks, delta=None, stats=None):
        """(attention input, new prefix, new blocks): the last MLP output `delta` (None at layer
        0) joins the prefix, a block-write layer saves it, then the mix and input_layernorm.
        `stats` from `pre_attention_statistics` stand in for the saved blocks."""
        site = self.plan.pre_attention
        return api.attn_res(prefix, blocks, *_weights(site.name, weights), num_blocks=site.num_blocks,
                            delta=_delta(site, delta), write_idx=site.write_idx, stats=stats,
                            backend=self.backend)

    def pre_attention_statistics(self, weights: AttnResWeights, blocks):
        """The pre-attention's softmax statistics of the saved blocks it mixes: computable as
        soon as the last block before this layer is written, i.e. one layer ahead."""
        weights = _weights("pre_attention_statistics", weights)
        return api.attn_res_statistics(blocks, weights.res_norm_w, weights.res_proj_w,
                                       num_blocks=self.plan.pre_attention.num_blocks,
                                       backend=self.backend)

    def post_attention(self, weights: AttnResWeights, x, o_proj, prefix, blocks,
                       peer_table=None, ahead: AttnResWeights | None = None):
        """(MLP input, new prefix, new blocks) from this rank's attention output x [B, K_local]
        and o_proj shard [H, K_local]: o_proj, the all-reduce over `axis_name`, the mix.

        `ahead`: the next call site's weights (layer i + 1's pre-attention, or after the last
        layer the final call's), which mixes the same saved blocks: its statistics come back
        as a fourth result, for its `stats=`."""
        return self._tail(functools.partial(api.oproj_attn_res, axis_name=self.axis_name),
                          weights, x, o_proj, prefix, blocks, peer_table, ahead)

    def post_attention_virtual(self, weights: AttnResWeights, x, o_proj, prefix, blocks,
                               peer_table=None, ahead: AttnResWeights | None = None):
        """`post_attention` with every TP rank on this device ("virtual TP", outside
        shard_map, with a `Mailbox.virtual` mailbox): x [TP, B, K/TP] and o_proj
        [TP, H, K/TP] are the ranks' shards. The ranks agree bit for bit; this returns rank
        0's results, as `post_attention` does."""
        out, prefix, blocks, *stats = self._tail(api.oproj_attn_res_virtual, weights, x, o_proj,
                                                 prefix, blocks, peer_table, ahead)
        return (out[0], prefix[0], blocks, *jax.tree.map(lambda a: a[0], stats))

    def _tail(self, tail, weights, x, o_proj, prefix, blocks, peer_table, ahead):
        """`tail` (the mesh's or virtual TP's oproj_attn_res) at this layer's post-attention."""
        site = self.plan.post_attention
        if ahead is not None:
            _weights(site.name, ahead, "ahead")
        return tail(x, o_proj, prefix, blocks, *_weights(site.name, weights),
                    num_blocks=site.num_blocks, has_delta=site.has_delta, mailbox=self.mailbox,
                    peer_table=peer_table,
                    ahead=None if ahead is None else (ahead.res_norm_w, ahead.res_proj_w),
                    two_shot=self.two_shot, variant=self.variant, backend=self.backend)


def final_attn_res(weights: AttnResWeights, prefix, blocks, delta, *, stats=None,
                   num_layers=KIMI_K3.num_layers, backend: Backend = "auto"):
    """The AttnRes after the last of `num_layers` layers (model.norm as the output norm);
    `stats` from the last layer's `post_attention(ahead=)` stand in for the saved blocks."""
    site = KIMI_K3.final(num_layers)
    return api.attn_res(prefix, blocks, *_weights("final", weights), num_blocks=site.num_blocks,
                        delta=_delta(site, delta), stats=stats, backend=backend)[0]
