"""The Lamport all-reduce as kernel calls inside jax.jit (kernels/lamport.py has the kernels and
the protocol); this module imports no part of the CuTe DSL."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kimik3.kernels.launch import Variant, launch

MAX_SPINS = 1 << 22  # polls of one word before a consumer gives up (seconds, not forever)


def _token():
    return jax.ShapeDtypeStruct((1,), jnp.int32)


def publish(rows, table, rank, *, layout, parity, two_shot=False, multicast=False, after=None):
    """This rank's producer: its rows into the mailbox slots; returns its int32 [1] token.

    `after`: an array XLA must finish first (the protocol needs the previous use of this
    parity consumed before the publish; data flow usually implies it). `multicast`: the
    table's row T is a multicast address over every rank's buffer."""
    return launch(Variant("publish", (layout, parity, two_shot, multicast)), _token())(
        rows, table, rank, rows if after is None else after)


def reduce_chunk(table, rank, after, *, layout, parity, batch, max_spins=MAX_SPINS,
                 multicast=False):
    """Two-shot owner `rank`: its column chunk of the `batch` rows, summed over the receive
    slots and sent to every rank's gather region, once `after` (the publishes' tokens) is done;
    returns its token."""
    return launch(Variant("owner", (layout, parity, batch, max_spins, multicast)), _token())(
        table, rank, after)


def all_reduce(rows, table, rank, *, layout, parity, two_shot=False, multicast=False,
               max_spins=MAX_SPINS, after=None):
    """One rank's all-reduced rows [B, H] bf16 (inside shard_map: `rank` = its axis index [1]);
    `after` and `multicast` as in `publish`."""
    batch = rows.shape[0]
    token = publish(rows, table, rank, layout=layout, parity=parity, two_shot=two_shot,
                    multicast=multicast, after=after)
    if two_shot:
        token = reduce_chunk(table, rank, token, layout=layout, parity=parity, batch=batch,
                             max_spins=max_spins, multicast=multicast)
    return launch(Variant("consume", (layout, parity, two_shot, max_spins)),
                  jax.ShapeDtypeStruct(rows.shape, rows.dtype))(table, rank, token)


def all_reduce_virtual(partials, table, *, layout, parity, two_shot=False, max_spins=MAX_SPINS,
                       after=None):
    """All T ranks on one GPU: every producer, [every owner,] then every consumer.

    partials [T, B, H] bf16 → [T, B, H] bf16, each rank's all-reduced rows.
    """
    tp, batch = partials.shape[0], partials.shape[1]
    ranks = [jnp.full((1,), r, jnp.int32) for r in range(tp)]
    tokens = jnp.concatenate([publish(partials[r], table, ranks[r], layout=layout, parity=parity,
                                      two_shot=two_shot, after=after) for r in range(tp)])
    if two_shot:
        tokens = jnp.concatenate([
            reduce_chunk(table, ranks[r], tokens, layout=layout, parity=parity, batch=batch,
                         max_spins=max_spins) for r in range(tp)])
    out = jax.ShapeDtypeStruct(partials.shape[1:], partials.dtype)
    return jnp.stack([
        launch(Variant("consume", (layout, parity, two_shot, max_spins)), out)(
            table, ranks[r], tokens) for r in range(tp)])


def unarmed_words(table, *, layout, after):
    """int32 [1]: words of all armed regions not holding SENTINEL, read after `after` is done."""
    return launch(Variant("armed_check", (layout,)), _token(), {2: 0})(
        table, after, jnp.zeros((1,), jnp.int32))
