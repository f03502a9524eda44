"""Trace-time checks of the public API's arguments; all problems of a call raise one ValueError."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kimik3.backend import BACKENDS
from jax_kimik3.config import KIMI_K3

CAPACITY = KIMI_K3.mailbox_capacity


class Checker:
    """Collects the problems of one call's arguments; `done()` raises them together."""

    def __init__(self, where: str):
        self.where, self.problems = where, []

    def fail(self, message: str):
        self.problems.append(message)

    def array(self, name, a, shape, dtype) -> bool:
        """`a` must have `shape` (None entries are free) and `dtype`."""
        ok = a.ndim == len(shape) and all(s is None or s == d for s, d in zip(shape, a.shape))
        if not ok or a.dtype != dtype:
            want = tuple("?" if s is None else s for s in shape)
            self.fail(f"{name} has shape={tuple(a.shape)} dtype={a.dtype}; "
                      f"expected shape={want} dtype={jnp.dtype(dtype)}".replace("'?'", "?"))
            return False
        return True

    def batch(self, name, b, capacity=CAPACITY):
        if not 1 <= b <= capacity:
            self.fail(f"{name} has batch B={b}; must be in [1, {capacity}] (mailbox capacity)")

    def positive(self, name, value):
        if not value > 0:
            self.fail(f"{name}={value} must be > 0")

    def done(self):
        if self.problems:
            raise ValueError(f"{self.where}: " + "; ".join(self.problems))


def check_blocks(check, blocks, *, num_blocks, write_idx=-1, rows=None):
    """blocks bf16 [B, NB, H] (B, H from `rows` when given); K and the write within NB.

    Returns (B, H), or None when the shape is unusable.
    """
    want = (None, None, None) if rows is None else (rows[0], None, rows[1])
    if not check.array("blocks", blocks, want, jnp.bfloat16):
        return None
    b, nb, h = blocks.shape
    check.batch("blocks", b)
    if not 0 <= num_blocks <= nb:
        check.fail(f"num_blocks={num_blocks} must be in [0, NB={nb}] (blocks.shape[1])")
    elif write_idx != -1 and not num_blocks <= write_idx < nb:
        check.fail(f"write_idx={write_idx} must be -1 or in [num_blocks={num_blocks}, NB={nb})")
    return b, h


def check_rows(check, name, a):
    """`a` bf16 [B, H] with 1 <= B <= CAPACITY; returns (B, H) or None."""
    if a.ndim != 2 or a.dtype != jnp.bfloat16:
        check.fail(f"{name} has shape={tuple(a.shape)} dtype={a.dtype}; expected [B, H] bfloat16")
        return None
    check.batch(name, a.shape[0])
    return a.shape


def check_weights(check, h, eps, **weights):
    """Each given weight bf16 [H]; eps > 0."""
    for name, w in weights.items():
        if w is not None:
            check.array(name, w, (h,), jnp.bfloat16)
    check.positive("eps", eps)


def check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks,
                   eps, out_eps, delta=None, write_idx=-1, stats=None):
    """Every `attn_res` argument; returns (B, H) or None."""
    rows = check_rows(check, "prefix", prefix)
    if rows is None:
        return None
    b, h = rows
    check_blocks(check, blocks, num_blocks=num_blocks, write_idx=write_idx, rows=rows)
    check_weights(check, h, eps, res_norm_w=res_norm_w, res_proj_w=res_proj_w,
                  out_norm_w=out_norm_w)
    check.positive("out_eps", out_eps)
    if delta is not None:
        check.array("delta", delta, (b, h), jnp.bfloat16)
    if stats is not None:
        if not (isinstance(stats, (tuple, list)) and len(stats) == 2):
            check.fail(f"stats must be a (mixture, scal) pair, got {type(stats).__name__}")
        else:
            check.array("stats[0] (mixture)", stats[0], (b, h), jnp.float32)
            check.array("stats[1] (scal)", stats[1], (b, 2), jnp.float32)
    return rows


def check_backend(check, backend):
    if backend not in BACKENDS:
        check.fail(f"backend={backend!r} must be one of {BACKENDS}")


def check_mailbox_rows(check, rows, name, mailbox, parity, axis_name=None, peer_table=None):
    """Rows that fit the mailbox, a parity, (in shard_map) one rank per mailbox buffer, and a
    peer table: `peer_table` if given (uint32 [T + 1, 2]), else the mailbox's own."""
    layout = mailbox.layout
    if check.array(name, rows, (None, layout.hidden), jnp.bfloat16):
        check.batch(name, rows.shape[0], layout.capacity)
    if parity not in (0, 1):
        check.fail(f"parity={parity} must be 0 or 1 (layer index % 2)")
    if axis_name is not None and jax.lax.axis_size(axis_name) != mailbox.tp:
        check.fail(f"axis {axis_name!r} has {jax.lax.axis_size(axis_name)} ranks; the mailbox "
                   f"has tp={mailbox.tp}")
    if peer_table is not None:
        check.array("peer_table", peer_table, (mailbox.tp + 1, 2), jnp.uint32)
    elif getattr(mailbox, "peer_table", None) is None:
        check.fail(f"mailbox={mailbox!r} has no memory: pass its peer_table= (uint32 "
                   f"[{mailbox.tp + 1}, 2], Mailbox.peer_table of the live mailbox)")
