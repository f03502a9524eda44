"""The Lamport all-reduce as a kernel call inside jax.jit (kernels/lamport.py has the kernels and
the protocol); this module imports no part of the CuTe DSL."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kimik3.kernels.launch import Signature, Variant
from jax_kimik3.layout import MailboxSpec


def kernel_spec(spec: MailboxSpec) -> MailboxSpec:
    """What the kernels compile from a mailbox spec: layout, multicast and the timeout (not
    whether its buffers share a device, nor how many groups it serves: a kernel sees one
    group's peer table)."""
    return dataclasses.replace(spec.spec, virtual=False, groups=1)


ALL_REDUCE = Signature(inputs=("rows", "table", "ranks"), outputs=("out",))  # lamport.AllReduce
ARMED_CHECK = Signature(inputs=("table", "after"), outputs=("count",))  # lamport.ArmedCheck


def all_reduce(rows, table, ranks, *, spec: MailboxSpec, two_shot=False):
    """Ranks `ranks` (int32 [R]) all-reduce their rows [R, B, H] bf16 through the mailbox of
    `spec` (peer table `table`): each rank's sum [R, B, H], bitwise identical across ranks. One
    custom call: every rank's publish, [every owner,] then every consumer. Under shard_map,
    R = 1 and `ranks` is this rank's axis index."""
    r, b, h = rows.shape
    out = ALL_REDUCE.call(Variant("all_reduce", (kernel_spec(spec), r, two_shot)),
                          dict(rows=rows.reshape(r * b, h), table=table, ranks=ranks),
                          {"out": jax.ShapeDtypeStruct((r * b, h), rows.dtype)})["out"]
    return out.reshape(r, b, h)


def unarmed_words(table, *, layout, after):
    """int32 [1]: words of all armed regions not holding SENTINEL, read after `after` is done."""
    return ARMED_CHECK.call(Variant("armed_check", (layout,)), dict(table=table, after=after),
                            {}, into={"count": jnp.zeros((1,), jnp.int32)})["count"]
