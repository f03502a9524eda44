"""The kernel calls of Kimi K3 decode steps: what the prebuilt library (jax_kimik3.native_build)
compiles, found by tracing the calls that make them. Imports no part of the CuTe DSL.

Per TP in `tps` (default TP_VALUES) and the first `num_layers` layers:
1. the canonical decode step (jax_kimik3.decode) with and without statistics ahead, once per
   tail region: the batches 1..64 whose post-attention tail launches one `oproj.TailChoice`
   (the tables' variant and all-reduce, the producer's B tiles), traced at a batch symbolic
   within the region (the kernels read it at run time), or at the region's one batch where
   the kernel is compiled for it (fused). So the catalog follows `oproj.choose` and `tuning`
   by construction. Symbolic regions come first: a call seen at both keeps its symbolic
   trace, which is what the library compiles;
2. what the step does not reach at that layer count: the final AttnRes after fewer layers
   (with and without statistics), layer 0's pre-attention with statistics (of no saved block:
   the step passes none there, a loop that passes them at every layer does), the statistics
   kernel of every K >= 1, the one-shot mailbox all-reduce (`all_reduce`).
The mailbox is MailboxSpec(MailboxLayout(tp)) with the default timeout. Not included (JIT
only): the two-shot all-reduce, tails of several ranks per launch (virtual TP), multicast
mailboxes, other eps or timeouts, `into=` buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from jax_kimik3 import decode, tuning
from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels import attn_res_ops, lamport_ops, oproj
from jax_kimik3.layer import AttentionTail, AttnResWeights, final_attn_res
from jax_kimik3.layout import MailboxLayout, MailboxSpec
from jax_kimik3.statistics import AttnResStatistics

TP_VALUES = (1, 2, 4, 8, 16)
H, NB, EPS = KIMI_K3.hidden_size, KIMI_K3.num_attn_res_blocks, KIMI_K3.rms_norm_eps
Entry = tuple[str, Callable, tuple]  # (what, function, its ShapeDtypeStruct arguments)


def _shape(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def tail_regions(tp, ahead) -> list[tuple[oproj.TailChoice, int, int]]:
    """(TailChoice, first, last batch) of every run of batches 1..64 at K = 12288 / TP where
    the tables' answers (`tuning.tail_variant`, `tuning.use_two_shot`) and what the tail
    launches stay the same: a batch symbolic within the run decides as each of its batches."""
    k = KIMI_K3.o_proj_local_features(tp)
    regions = []
    for batch in range(1, KIMI_K3.mailbox_capacity + 1):
        choice = oproj.choose(batch, k, tp, ahead)
        key = (choice, tuning.tail_variant(batch, k), tuning.use_two_shot(batch, tp))
        if regions and regions[-1][0] == key:
            regions[-1][2] = batch
        else:
            regions.append([key, batch, batch])
    return [(key[0], first, last) for key, first, last in regions]


def region_batch(choice: oproj.TailChoice, first: int, last: int):
    """The batch to trace a region at: the fused kernel's own, else symbolic in the region."""
    if choice.batch is not None:
        return choice.batch
    return jax.export.symbolic_shape(
        "b", constraints=(f"b >= {first}", f"b <= {last}"))[0]


def _step(tp, num_layers, ahead):
    """The canonical step on an abstract mesh of `tp` devices: step(params, embedding, blocks,
    table)."""
    return decode.make_step(AbstractMesh((tp,), (decode.AXIS,)), decode.param_shapes(num_layers),
                            num_layers, "kernel", MailboxSpec(MailboxLayout(tp)),
                            stats_ahead=ahead)


def _final(num_layers, precomputed):
    def call(prefix, blocks, g, w, o, delta, mixture, scal):
        stats = AttnResStatistics(mixture, scal, KIMI_K3.final(num_layers).num_blocks)
        return final_attn_res(AttnResWeights(g, w, o), prefix, blocks, delta,
                              stats=stats if precomputed else None, num_layers=num_layers,
                              backend="kernel")
    return call


def _first_pre_attention(prefix, blocks, g, w, o, mixture, scal):
    plan = KIMI_K3.layer(0)
    stats = AttnResStatistics(mixture, scal, plan.pre_attention.num_blocks)
    return AttentionTail(plan, backend="kernel").pre_attention(
        AttnResWeights(g, w, o), prefix, blocks, stats=stats)


def _statistics(num_blocks):
    def call(blocks, g, w):
        return attn_res_ops.attn_res_statistics(blocks, g, w, num_blocks=num_blocks, eps=EPS)
    return call


def _all_reduce(spec):
    def call(rows, table, rank):
        return lamport_ops.all_reduce(rows[None], table, rank, spec=spec)
    return call


def decode_calls(tps=TP_VALUES, num_layers=KIMI_K3.num_layers) -> Iterator[Entry]:
    """Every entry above once (calls repeat across entries: name them to dedupe)."""
    for tp in tps:
        if tp not in TP_VALUES:
            raise ValueError(f"tp={tp} must be one of {TP_VALUES}")
    if not 1 <= num_layers <= KIMI_K3.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {KIMI_K3.num_layers}]")
    steps = []
    for tp in tps:
        for ahead in (False, True):
            for choice, first, last in tail_regions(tp, ahead):
                b = region_batch(choice, first, last)
                steps.append((choice.batch is not None, (
                    f"TP{tp} decode step, {num_layers} layers, B={first}..{last} "
                    f"({choice}), stats ahead={ahead}", _step(tp, num_layers, ahead),
                    (decode.param_shapes(num_layers), _shape(b, H), _shape(b, NB, H),
                     _shape(tp, tp + 1, 2, dtype=jnp.uint32)))))
    yield from (entry for _, entry in sorted(steps, key=lambda s: s[0]))  # symbolic first
    b = jax.export.symbolic_shape("b", constraints=(f"b <= {KIMI_K3.mailbox_capacity}",))[0]
    rows = (_shape(b, H), _shape(b, NB, H)) + (_shape(H),) * 3 + (_shape(b, H),)
    f32 = (_shape(b, H, dtype=jnp.float32), _shape(b, 2, dtype=jnp.float32))
    for n in range(1, num_layers + 1):
        for precomputed in (False, True):
            yield (f"final after {n} layers, stats={precomputed}", _final(n, precomputed),
                   rows + f32)
    yield ("layer 0's pre-attention, stats=True", _first_pre_attention, rows[:-1] + f32)
    for num_blocks in range(1, KIMI_K3.final(num_layers).num_blocks + 1):
        yield (f"statistics K={num_blocks}", _statistics(num_blocks),
               (_shape(b, NB, H), _shape(H), _shape(H)))
    for tp in tps:
        spec = MailboxSpec(MailboxLayout(tp))
        yield (f"TP{tp} all-reduce", _all_reduce(spec),
               (_shape(b, H), _shape(tp + 1, 2, dtype=jnp.uint32), _shape(1, dtype=jnp.int32)))
