"""The kernel calls of Kimi K3 decode steps, from the config plan: what the prebuilt library
(jax_kimik3.native_build) compiles. Imports no part of the CuTe DSL.

Per TP in `tps` (default TP_VALUES) and the first `num_layers` layers:
1. pre-attention AttnRes of every layer and the final AttnRes after any number of layers,
   each with and without precomputed statistics, and the statistics kernel of every K >= 1
   (`AttentionTail.pre_attention[_statistics]`, `final_attn_res`);
2. the post-attention tail (`oproj_attn_res` with a mailbox) of every distinct
   post-attention site (saved blocks, delta) of those layers, with and without statistics
   ahead, in each (variant, two-shot) that `oproj.tail`'s choice (`tuning`) makes at some
   batch at K = 12288 / TP: "xla" and "split" once each (they read the batch at run time;
   split per producer B tile count), "fused" at every batch it is chosen for;
3. the one-shot mailbox all-reduce (`all_reduce`).
The mailbox is MailboxSpec(MailboxLayout(tp)) with the default timeout. Not included (JIT
only): the two-shot all-reduce, tails of several ranks per launch (virtual TP), multicast
mailboxes, other eps or timeouts, `into=` buffers. tests/test_catalog.py checks that decode
steps at every TP make no other kernel call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels import attn_res_ops, lamport_ops, oproj, producer_ops
from jax_kimik3.mailbox import MailboxLayout, MailboxSpec

TP_VALUES = (1, 2, 4, 8, 16)
H, NB, EPS = KIMI_K3.hidden_size, KIMI_K3.num_attn_res_blocks, KIMI_K3.rms_norm_eps
Entry = tuple[str, Callable, tuple]  # (what, function, its ShapeDtypeStruct arguments)


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _rows(batch):
    """prefix/delta [B, H], blocks [B, NB, H], the three weights [H]."""
    return (_spec(batch, H), _spec(batch, NB, H)) + (_spec(H),) * 3


def _attn_res(site, precomputed):
    def call(prefix, blocks, g, w, o, delta, mixture, scal):
        return attn_res_ops.attn_res(
            prefix, blocks, g, w, o, num_blocks=site.num_blocks,
            delta=delta if site.has_delta else None, write_idx=site.write_idx, eps=EPS,
            out_eps=EPS, stats=(mixture, scal) if precomputed else None)
    return call


def _statistics(num_blocks):
    def call(blocks, g, w):
        return attn_res_ops.attn_res_statistics(blocks, g, w, num_blocks=num_blocks, eps=EPS)
    return call


def _tail(spec, site, ahead, variant, two_shot, tiles):
    def call(x, w, prefix, blocks, g, pw, o, table, rank):
        return oproj.launch_tail(x[None], w[None], prefix, blocks, g, pw, o, table=table,
                                 ranks=rank, spec=spec, num_blocks=site.num_blocks,
                                 has_delta=site.has_delta, eps=EPS, out_eps=EPS,
                                 ahead=(g, pw) if ahead else None, variant=variant,
                                 two_shot=two_shot, tiles=tiles)
    return call


def _all_reduce(spec):
    def call(rows, table, rank):
        return lamport_ops.all_reduce(rows[None], table, rank, spec=spec)
    return call


def tail_choices(tp, ahead) -> dict:
    """{(variant, two_shot, tiles): the batches it is chosen for} at K = 12288 / TP."""
    k = KIMI_K3.o_proj_local_features(tp)
    choices = {}
    for batch in range(1, KIMI_K3.mailbox_capacity + 1):
        variant, two_shot = oproj._choose(None, None, batch, k, tp, () if ahead else None)
        tiles = producer_ops.tiles(batch) if variant == "split" else None
        key = (variant, two_shot, tiles, batch if variant == "fused" else None)
        choices.setdefault(key, []).append(batch)
    return choices


def decode_calls(tps=TP_VALUES, num_layers=KIMI_K3.num_layers) -> Iterator[Entry]:
    """Every entry point call above once (calls repeat across entries: name them to dedupe)."""
    for tp in tps:
        if tp not in TP_VALUES:
            raise ValueError(f"tp={tp} must be one of {TP_VALUES}")
    if not 1 <= num_layers <= KIMI_K3.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {KIMI_K3.num_layers}]")
    b = jax.export.symbolic_shape("b")[0]
    f32 = (_spec(b, H, dtype=jnp.float32), _spec(b, 2, dtype=jnp.float32))
    plans = KIMI_K3.layers()[:num_layers]
    sites = [(f"layer {plan.index} pre-attention", plan.pre_attention) for plan in plans]
    sites += [(f"final after {n} layers", KIMI_K3.final(n)) for n in range(1, num_layers + 1)]
    for what, site in sites:
        for precomputed in (False, True):
            yield (f"{what}, stats={precomputed}", _attn_res(site, precomputed),
                   _rows(b) + (_spec(b, H),) + f32)
    for num_blocks in sorted({site.num_blocks for _, site in sites} - {0}):
        yield (f"statistics K={num_blocks}", _statistics(num_blocks),
               (_spec(b, NB, H), _spec(H), _spec(H)))
    posts = sorted({(p.post_attention.num_blocks, p.post_attention.has_delta): p.post_attention
                    for p in plans}.items())
    for tp in tps:
        spec, k = MailboxSpec(MailboxLayout(tp)), KIMI_K3.o_proj_local_features(tp)
        mailbox = (_spec(tp + 1, 2, dtype=jnp.uint32), _spec(1, dtype=jnp.int32))
        for ahead in (False, True):
            for (variant, two_shot, tiles, batch), _ in sorted(
                    tail_choices(tp, ahead).items(), key=str):
                rows = b if batch is None else batch
                for (num_blocks, has_delta), site in posts:
                    yield (f"TP{tp} post-attention K={num_blocks} delta={has_delta} {variant} "
                           f"two_shot={two_shot} tiles={tiles} B={batch} ahead={ahead}",
                           _tail(spec, site, ahead, variant, two_shot, tiles),
                           (_spec(rows, k), _spec(H, k)) + _rows(rows) + mailbox)
        yield (f"TP{tp} all-reduce", _all_reduce(spec), (_spec(b, H),) + mailbox)
