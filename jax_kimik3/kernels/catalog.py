"""The kernel calls of Kimi K3 decode steps, from the config plan: what the prebuilt library
(jax_kimik3.native_build) compiles. Imports no part of the CuTe DSL.

Per TP in `tps` (default TP_VALUES) and the first `num_layers` layers:
1. pre-attention AttnRes of every layer and the final AttnRes after any number of layers,
   each with and without precomputed statistics, and the statistics kernel of every K >= 1
   (`AttentionTail.pre_attention[_statistics]`, `final_attn_res`);
2. the post-attention tail (`oproj_attn_res` with a mailbox) of every layer at its parity, in
   each variant `tuning.tail_variant` and `tuning.use_two_shot` pick at K = 12288 / TP: the
   Lamport publish of XLA's dot, the o_proj producer (at every batch the producer runs:
   "split", and "fused" with statistics ahead), the fused tail (at every batch it is picked
   for), the two-shot owner (at every batch two-shot is picked for); and the AttnRes ring
   consumer, with and without statistics ahead, one-shot and (where picked) two-shot;
3. the one-shot mailbox all-reduce (`all_reduce`).
Batch is symbolic: those kernels read it at run time, one object for every B in [1, 64]; the
producer, the owner and the fused tail are compiled per batch. Not included (JIT only): the
two-shot all-reduce and tail where the tables do not pick them, the fused tail of several
ranks per launch (virtual TP), multicast mailboxes, other eps or max_spins, `into=` buffers.
tests/test_catalog.py checks that decode steps at every TP make no other kernel call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jax_kimik3 import tuning
from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels import attn_res_ops, lamport_ops, oproj, producer_ops
from jax_kimik3.mailbox import MailboxLayout

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


def _tail(layout, site, parity, ahead, two_shot):
    """oproj_attn_res's kernels where XLA's dot makes the rows ("xla", kernels/oproj.py): the
    publish and the ring consumer, the latter with statistics `ahead` or without (the two-shot
    owner between them is compiled per batch: `_reduce_chunk`)."""
    def call(rows, prefix, blocks, g, w, o, table, rank):
        token = lamport_ops.publish(rows, table, rank, layout=layout, parity=parity,
                                    two_shot=two_shot)
        ring = attn_res_ops.Ring(layout, parity, lamport_ops.MAX_SPINS, two_shot,
                                 site.has_delta, table, rank, token)
        return attn_res_ops.attn_res(prefix, blocks, g, w, o, num_blocks=site.num_blocks,
                                     delta=None, write_idx=-1, eps=EPS, out_eps=EPS, stats=None,
                                     ring=ring, ahead=(g, w) if ahead else None)
    return call


def _produce(layout, parity, two_shot):
    def call(x, w, table, rank):
        return producer_ops.produce(x, w, table, rank, layout=layout, parity=parity,
                                    two_shot=two_shot)
    return call


def _reduce_chunk(layout, parity, batch):
    def call(table, rank, token):
        return lamport_ops.reduce_chunk(table, rank, token, layout=layout, parity=parity,
                                        batch=batch)
    return call


def _fused(layout, site, parity):
    def call(x, w, prefix, blocks, g, pw, o, table, rank):
        return oproj.oproj_attn_res(x, w, prefix, blocks, g, pw, o, table=table, rank=rank,
                                    layout=layout, parity=parity, num_blocks=site.num_blocks,
                                    has_delta=site.has_delta, eps=EPS, out_eps=EPS,
                                    two_shot=False, variant="fused")
    return call


def _all_reduce(layout, parity):
    def call(rows, table, rank):
        return lamport_ops.all_reduce(rows, table, rank, layout=layout, parity=parity)
    return call


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
    batches = range(1, KIMI_K3.mailbox_capacity + 1)
    for tp in tps:
        layout, k = MailboxLayout(tp), KIMI_K3.o_proj_local_features(tp)
        mailbox = (_spec(tp + 1, 2, dtype=jnp.uint32), _spec(1, dtype=jnp.int32))
        two_shot_batches = [batch for batch in batches if tuning.use_two_shot(batch, tp)]
        for plan in plans:
            site = plan.post_attention
            for two_shot in sorted({False, bool(two_shot_batches)}):
                for ahead in (False, True):
                    yield (f"TP{tp} layer {plan.index} post-attention ring, ahead={ahead}, "
                           f"two_shot={two_shot}",
                           _tail(layout, site, plan.parity, ahead, two_shot),
                           (_spec(b, H),) + _rows(b) + mailbox)
            for batch in batches:
                if tuning.tail_variant(batch, k) == "fused":
                    yield (f"TP{tp} layer {plan.index} fused tail B={batch}",
                           _fused(layout, site, plan.parity),
                           (_spec(batch, k), _spec(H, k)) + _rows(batch) + mailbox)
        for parity in (0, 1):
            for batch in batches:
                two_shot = batch in two_shot_batches
                if tuning.use_producer(batch, k):
                    yield (f"TP{tp} o_proj producer B={batch} parity {parity}",
                           _produce(layout, parity, two_shot),
                           (_spec(batch, k), _spec(H, k)) + mailbox)
                if two_shot:
                    yield (f"TP{tp} two-shot owner B={batch} parity {parity}",
                           _reduce_chunk(layout, parity, batch),
                           mailbox + (_spec(1, dtype=jnp.int32),))
            yield (f"TP{tp} all-reduce parity {parity}", _all_reduce(layout, parity),
                   (_spec(b, H),) + mailbox)
