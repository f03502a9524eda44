"""The public API (DESIGN.md §3): argument checks, then the math."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kimik3 import reference
from jax_kimik3.backend import Backend, use_kernels
from jax_kimik3.validation import (Checker, check_attn_res, check_backend, check_blocks,
                                   check_mailbox_rows, check_weights)


def _table(mailbox, peer_table):
    """The peer table operand: `peer_table`, or the live mailbox's own as a constant."""
    return jnp.asarray(mailbox.peer_table) if peer_table is None else peer_table


def _kernels():
    """The kernel calls, imported on first use (JIT mode then loads the CuTe DSL)."""
    from jax_kimik3.kernels import attn_res_ops
    return attn_res_ops


@functools.partial(jax.jit, static_argnames=("num_blocks", "write_idx", "eps", "out_eps",
                                             "backend"))
def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta=None,
             write_idx=-1, eps=1e-5, out_eps=1e-5, stats=None, backend: Backend = "auto"):
    """Block AttnRes: mix `num_blocks` saved blocks with the (delta-updated) prefix, then RMSNorm.

    Returns (out [B, H] bf16, new_prefix [B, H] bf16, new_blocks [B, NB, H] bf16).
    `write_idx` >= 0 stores the new prefix to blocks[:, write_idx] first; `out_norm_w=None`
    returns the mix itself; `stats=(mixture, scal)` from `attn_res_statistics` stands in for
    the saved blocks. `backend`: "auto" (kernels on a GPU), "kernel" or "reference".
    """
    check = Checker("attn_res")
    check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                   num_blocks=num_blocks, eps=eps, out_eps=out_eps, delta=delta,
                   write_idx=write_idx, stats=stats)
    check_backend(check, backend)
    check.done()
    impl = _kernels() if use_kernels(backend, prefix.shape[1]) else reference
    return impl.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                         num_blocks=num_blocks, delta=delta, write_idx=write_idx, eps=eps,
                         out_eps=out_eps, stats=stats)


@functools.partial(jax.jit, static_argnames=("num_blocks", "eps", "backend"))
def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps=1e-5,
                        backend: Backend = "auto"):
    """Softmax statistics of blocks[:, :num_blocks]: (mixture [B, H] f32, scal [B, 2] f32 = (m, s))."""
    check = Checker("attn_res_statistics")
    rows = check_blocks(check, blocks, num_blocks=num_blocks)
    if rows is not None:
        check_weights(check, rows[1], eps, res_norm_w=res_norm_w, res_proj_w=res_proj_w)
    check_backend(check, backend)
    check.done()
    impl = _kernels() if use_kernels(backend, blocks.shape[2]) else reference
    return impl.attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=num_blocks,
                                    eps=eps)


@functools.partial(jax.jit, static_argnames=("axis_name", "num_blocks", "has_delta", "eps",
                                             "out_eps", "mailbox", "parity", "two_shot",
                                             "backend"))
def oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, axis_name,
                   num_blocks, has_delta, eps=1e-5, out_eps=1e-5, mailbox=None, parity=0,
                   peer_table=None, ahead=None, two_shot=None, backend: Backend = "auto"):
    """Row-parallel o_proj, its all-reduce over `axis_name`, then the post-attention AttnRes.

    Call inside `shard_map`: x [B, K_local] and w [H, K_local] are this rank's shards.
    Returns (out, new_prefix, new_blocks); without `has_delta` the new prefix is the reduced
    attn_out (a new block starts) and `prefix` is not read. With a `mailbox` (one buffer per
    rank of `axis_name`) and `parity` (layer % 2) the all-reduce and AttnRes run as kernels:
    the o_proj producer publishes, then an AttnRes kernel sums the mailbox slots (in one fused
    launch or two, or with XLA's dot, as `tuning.TAIL_VARIANTS` says for B, K); without one,
    XLA's dot, psum and the reference. `mailbox` may be a `MailboxSpec` with the peer table
    passed as the `peer_table` operand (for steps exported or compiled ahead of time).
    `ahead=(res_norm_w, res_proj_w)` of a later call site that mixes the same saved blocks
    (the next layer's pre-attention, or the final call): their statistics under those weights,
    as `attn_res_statistics` gives them, come back as a fourth result; the kernel path stores
    them from the blocks it reads anyway, so the later call reads no block. `two_shot`
    (kernels): True or False forces the two-shot or one-shot all-reduce; None takes the
    measured table (jax_kimik3/tuning.py).
    """
    check = Checker("oproj_attn_res")
    _check_tail(check, x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                num_blocks=num_blocks, eps=eps, out_eps=out_eps, ahead=ahead, mailbox=mailbox,
                parity=parity, axis_name=axis_name, peer_table=peer_table, backend=backend)
    check.done()
    if mailbox is not None and use_kernels(backend, prefix.shape[1]):
        from jax_kimik3.kernels import oproj

        rank = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
        return oproj.oproj_attn_res(
            x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
            table=_table(mailbox, peer_table), rank=rank, layout=mailbox.layout, parity=parity,
            num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
            multicast=mailbox.multicast, ahead=None if ahead is None else tuple(ahead),
            two_shot=two_shot)
    results = reference.oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                                       axis_name=axis_name, num_blocks=num_blocks,
                                       has_delta=has_delta, eps=eps, out_eps=out_eps)
    return _with_ahead(results, blocks, ahead, num_blocks, eps)


@functools.partial(jax.jit, static_argnames=("num_blocks", "has_delta", "eps", "out_eps",
                                             "mailbox", "parity", "two_shot", "backend"))
def oproj_attn_res_virtual(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *,
                           num_blocks, has_delta, eps=1e-5, out_eps=1e-5, mailbox=None, parity=0,
                           peer_table=None, ahead=None, two_shot=None,
                           backend: Backend = "auto"):
    """Every TP rank's `oproj_attn_res` on one device ("virtual TP", no shard_map): x
    [TP, B, K/TP] and w [TP, H, K/TP] are the ranks' shards.

    Returns each rank's (out [TP, B, H], new_prefix [TP, B, H]), new_blocks, and with `ahead`
    each rank's (mixture [TP, B, H], scal [TP, B, 2]); the ranks agree bit for bit. With a
    `Mailbox.virtual` mailbox (or its spec and `peer_table=`) the kernels run every rank
    (one fused launch, or every rank's producer then every consumer); without one, the
    reference. The other arguments as in `oproj_attn_res`.
    """
    check = Checker("oproj_attn_res_virtual")
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0]:
        check.fail(f"x has shape={tuple(x.shape)} and w shape={tuple(w.shape)}; expected "
                   "[TP, B, K/TP] and [TP, H, K/TP]")
    elif mailbox is not None and x.shape[0] != mailbox.tp:
        check.fail(f"x has TP={x.shape[0]} shards; the mailbox has tp={mailbox.tp}")
    else:
        _check_tail(check, x[0], w[0], prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                    num_blocks=num_blocks, eps=eps, out_eps=out_eps, ahead=ahead,
                    mailbox=mailbox, parity=parity, peer_table=peer_table, backend=backend)
    check.done()
    if mailbox is not None and use_kernels(backend, prefix.shape[1]):
        from jax_kimik3.kernels import oproj

        results = oproj.tail_virtual(
            x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
            table=_table(mailbox, peer_table), layout=mailbox.layout, parity=parity,
            num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
            ahead=None if ahead is None else tuple(ahead), two_shot=two_shot)
        return (*results[:2], blocks, *results[2:])
    out, new_prefix, new_blocks, *stats = _with_ahead(reference.oproj_attn_res_virtual(
        x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks,
        has_delta=has_delta, eps=eps, out_eps=out_eps), blocks, ahead, num_blocks, eps)
    ranks = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (x.shape[0], *a.shape)))
    return (*ranks((out, new_prefix)), new_blocks, *ranks(stats))


def _check_tail(check, x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks,
                eps, out_eps, ahead, mailbox, parity, backend, axis_name=None, peer_table=None):
    """The arguments of one rank's post-attention tail, into `check`."""
    rows = check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                          num_blocks=num_blocks, eps=eps, out_eps=out_eps)
    if rows is not None and check.array("x", x, (rows[0], None), jnp.bfloat16):
        check.array("w", w, (rows[1], x.shape[1]), jnp.bfloat16)
    if ahead is not None and rows is not None:
        if not (isinstance(ahead, (tuple, list)) and len(ahead) == 2):
            check.fail(f"ahead must be a (res_norm_w, res_proj_w) pair, got {type(ahead).__name__}")
        else:
            check_weights(check, rows[1], eps, **{"ahead[0] (res_norm_w)": ahead[0],
                                                  "ahead[1] (res_proj_w)": ahead[1]})
    check_backend(check, backend)
    if mailbox is not None:
        check_mailbox_rows(check, prefix, "prefix", mailbox, parity, axis_name, peer_table)
    elif backend == "kernel":
        check.fail("backend='kernel' needs mailbox= (the all-reduce's peer buffers)")


def _with_ahead(results, blocks, ahead, num_blocks, eps):
    """The reference tail's results, with the `ahead` site's statistics if asked for."""
    if ahead is None:
        return results
    return (*results, reference.attn_res_statistics(blocks, *ahead, num_blocks=num_blocks,
                                                    eps=eps))


@functools.partial(jax.jit, static_argnames=("mailbox", "axis_name", "parity", "two_shot",
                                             "max_spins"))
def all_reduce(rows, mailbox, *, axis_name, parity, two_shot=False, max_spins=None,
               peer_table=None):
    """Sum of every TP rank's bf16 rows [B, H] through `mailbox`'s Lamport slots (in shard_map).

    One-shot: each rank receives every peer's rows; two-shot: each rank reduces the H/TP columns
    it owns and sends them back. Every rank gets bitwise-identical rows (fp32 sums in rank
    order). `parity` alternates by layer; `max_spins` bounds each poll (see kernels.lamport_ops);
    `peer_table` as in `oproj_attn_res`.
    """
    from jax_kimik3.kernels import lamport_ops as lamport

    check = Checker("all_reduce")
    check_mailbox_rows(check, rows, "rows", mailbox, parity, axis_name, peer_table)
    check.done()
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    return lamport.all_reduce(rows, _table(mailbox, peer_table), rank, layout=mailbox.layout,
                              parity=parity, two_shot=two_shot, multicast=mailbox.multicast,
                              max_spins=max_spins or lamport.MAX_SPINS)


@functools.partial(jax.jit, static_argnames=("mailbox", "parity", "two_shot", "max_spins"))
def all_reduce_virtual(partials, mailbox, *, parity, two_shot=False, max_spins=None, after=None):
    """Every rank on one GPU ("virtual TP"): partials [TP, B, H] bf16 → each rank's sum [TP, B, H].

    Runs every rank's producer, then every consumer, through a `Mailbox.virtual` mailbox.
    """
    from jax_kimik3.kernels import lamport_ops as lamport

    check = Checker("all_reduce_virtual")
    if partials.ndim != 3 or partials.shape[0] != mailbox.tp:
        check.fail(f"partials has shape={tuple(partials.shape)}; expected [tp={mailbox.tp}, B, H]")
    else:
        check_mailbox_rows(check, partials[0], "partials[r]", mailbox, parity)
    check.done()
    return lamport.all_reduce_virtual(partials, jnp.asarray(mailbox.peer_table),
                                      layout=mailbox.layout, parity=parity, two_shot=two_shot,
                                      max_spins=max_spins or lamport.MAX_SPINS, after=after)
