"""The public API (docs/model.md has the math and the contract): argument checks at trace time,
then the math on the kernels or the reference.

Each function checks its arguments in plain Python (so every problem is named before JAX
traces anything; static arguments must be hashable), then runs a jitted implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kimik3 import reference, tuning
from jax_kimik3.backend import Backend, kernel_problem, use_kernels
from jax_kimik3.config import KIMI_K3
from jax_kimik3.statistics import AttnResStatistics
from jax_kimik3.validation import (Checker, check_attn_res, check_axis, check_backend,
                                   check_blocks, check_fits, check_mailbox, check_rows,
                                   check_variant, check_weights)

EPS = KIMI_K3.rms_norm_eps


def _kernels():
    """The kernel calls, imported on first use (JIT mode then loads the CuTe DSL)."""
    from jax_kimik3.kernels import attn_res_ops
    return attn_res_ops


def _table(mailbox, peer_table):
    """The peer table operand, uint32 [T + 1, 2]: `peer_table` (a device's block of a
    MeshMailbox's table has leading axes of size 1), or the live mailbox's own as a constant."""
    if peer_table is None:
        return jnp.asarray(mailbox.peer_table)
    return peer_table.reshape(mailbox.spec.tp + 1, 2)


def attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta=None,
             write_idx=-1, eps=EPS, out_eps=EPS, stats=None, backend: Backend = "auto"):
    """Block AttnRes: mix `num_blocks` saved blocks with the (delta-updated) prefix, then RMSNorm.

    Returns (out [B, H] bf16, new_prefix [B, H] bf16, new_blocks [B, NB, H] bf16).
    `write_idx` >= 0 stores the new prefix to blocks[:, write_idx] first; `out_norm_w=None`
    returns the mix itself; `stats` (the AttnResStatistics of `attn_res_statistics` for the
    same `num_blocks`) stands in for the saved blocks. `backend`: "auto" (kernels on a GPU),
    "kernel" or "reference".
    """
    check = Checker("attn_res")
    if check.hashable(num_blocks=num_blocks, write_idx=write_idx, eps=eps, out_eps=out_eps,
                      backend=backend):
        rows = check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                              num_blocks=num_blocks, eps=eps, out_eps=out_eps, delta=delta,
                              write_idx=write_idx, stats=stats)
        check_backend(check, backend, None if rows is None else rows[1])
    check.done()
    return _attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, num_blocks=num_blocks,
                     delta=delta, write_idx=write_idx, eps=eps, out_eps=out_eps,
                     stats=None if stats is None else tuple(stats), backend=backend)


@functools.partial(jax.jit, static_argnames=("num_blocks", "write_idx", "eps", "out_eps",
                                             "backend"))
def _attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks, delta,
              write_idx, eps, out_eps, stats, backend):
    impl = _kernels() if use_kernels(backend, prefix.shape[1]) else reference
    return impl.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                         num_blocks=num_blocks, delta=delta, write_idx=write_idx, eps=eps,
                         out_eps=out_eps, stats=stats)


def attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps=EPS,
                        backend: Backend = "auto") -> AttnResStatistics:
    """Softmax statistics of blocks[:, :num_blocks]: AttnResStatistics (mixture [B, H] f32,
    scal [B, 2] f32 = (m, s)), for a later `attn_res(stats=...)` over the same blocks."""
    check = Checker("attn_res_statistics")
    if check.hashable(num_blocks=num_blocks, eps=eps, backend=backend):
        rows = check_blocks(check, blocks, num_blocks=num_blocks)
        if rows is not None:
            check_weights(check, rows[1], eps, res_norm_w=res_norm_w, res_proj_w=res_proj_w)
        check_backend(check, backend, None if rows is None else rows[1])
    check.done()
    mixture, scal = _attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=num_blocks,
                                         eps=eps, backend=backend)
    return AttnResStatistics(mixture, scal, num_blocks, eps)


@functools.partial(jax.jit, static_argnames=("num_blocks", "eps", "backend"))
def _attn_res_statistics(blocks, res_norm_w, res_proj_w, *, num_blocks, eps, backend):
    impl = _kernels() if use_kernels(backend, blocks.shape[2]) else reference
    return impl.attn_res_statistics(blocks, res_norm_w, res_proj_w, num_blocks=num_blocks,
                                    eps=eps)


def oproj_attn_res(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, axis_name,
                   num_blocks, has_delta, eps=EPS, out_eps=EPS, mailbox=None, peer_table=None,
                   ahead=None, two_shot=None, variant: tuning.TailVariant | None = None,
                   backend: Backend = "auto"):
    """Row-parallel o_proj, its all-reduce over `axis_name`, then the post-attention AttnRes.

    Call inside `shard_map`: x [B, K_local] and w [H, K_local] are this rank's shards.
    Returns (out, new_prefix, new_blocks); without `has_delta` the new prefix is the reduced
    attn_out (a new block starts) and `prefix` is not read. With a `mailbox` (a Mailbox of one
    buffer per rank of `axis_name`; a MeshMailbox, one per group of `axis_name` in a larger
    mesh or across processes, with this device's block of its `table` as `peer_table`; or a
    MailboxSpec with the live table as `peer_table`)
    the all-reduce and AttnRes run as kernels (one launch or several, as
    `tuning.TAIL_VARIANTS` says for B, K), the mailbox's buffers alternating with its calls;
    without one, XLA's dot, psum and the reference. `ahead=(res_norm_w, res_proj_w)` of a
    later call site that mixes the same saved blocks (the next layer's pre-attention, or the
    final call): their AttnResStatistics come back as a fourth result; the kernel path stores
    them from the blocks it reads anyway, so the later call reads no block. `two_shot`
    (kernels): True or False forces the two-shot or one-shot all-reduce; None takes the
    measured table (jax_kimik3/tuning.py). `variant` (kernels): "split", "xla" or "fused"
    (one-shot whatever the table's all-reduce; refused with `ahead`) forces that launch; None
    takes the table, measured on H200 and H100 parts (another GPU may rank the variants
    differently: benchmarks/bench_rank.py measures them).
    """
    check = Checker("oproj_attn_res")
    if check.hashable(axis_name=axis_name, num_blocks=num_blocks, has_delta=has_delta, eps=eps,
                      out_eps=out_eps, mailbox=mailbox, two_shot=two_shot, variant=variant,
                      backend=backend):
        size = check_axis(check, axis_name)
        _check_tail(check, x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                    num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
                    ahead=ahead, mailbox=mailbox, peer_table=peer_table, two_shot=two_shot,
                    variant=variant, backend=backend, axis_name=axis_name, ranks=size)
    check.done()
    out, new_prefix, new_blocks, *stats = _tail(
        x[None], w[None], prefix, blocks, res_norm_w, res_proj_w, out_norm_w, mailbox,
        peer_table, ahead, axis_name=axis_name, num_blocks=num_blocks, has_delta=has_delta,
        eps=eps, out_eps=out_eps, two_shot=two_shot, variant=variant, backend=backend)
    return (out[0], new_prefix[0], new_blocks, *jax.tree.map(lambda a: a[0], stats))


def oproj_attn_res_virtual(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *,
                           num_blocks, has_delta, eps=EPS, out_eps=EPS, mailbox=None,
                           peer_table=None, ahead=None, two_shot=None,
                           variant: tuning.TailVariant | None = None,
                           backend: Backend = "auto"):
    """Every TP rank's `oproj_attn_res` on one device ("virtual TP", no shard_map): x
    [TP, B, K/TP] and w [TP, H, K/TP] are the ranks' shards.

    Returns each rank's (out [TP, B, H], new_prefix [TP, B, H]), new_blocks, and with `ahead`
    each rank's AttnResStatistics (mixture [TP, B, H], scal [TP, B, 2]); the ranks agree bit
    for bit. With a `Mailbox.virtual` mailbox (or its spec and `peer_table=`) the kernels run
    every rank in the one composition `oproj_attn_res` runs for one (every rank's producer
    before any rank's consumer); without one, the reference. The other arguments as in
    `oproj_attn_res`.
    """
    check = Checker("oproj_attn_res_virtual")
    if check.hashable(num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
                      mailbox=mailbox, two_shot=two_shot, variant=variant, backend=backend):
        if not all(hasattr(a, "ndim") for a in (x, w)) or x.ndim != 3 or w.ndim != 3 or (
                x.shape[0] != w.shape[0]) or x.shape[0] < 1:
            check.fail(f"x has shape={getattr(x, 'shape', x)} and w shape="
                       f"{getattr(w, 'shape', w)}; expected [TP, B, K/TP] and [TP, H, K/TP] "
                       "with TP >= 1")
        else:
            _check_tail(check, x[0], w[0], prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                        num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps,
                        ahead=ahead, mailbox=mailbox, peer_table=peer_table, two_shot=two_shot,
                        variant=variant, backend=backend, ranks=x.shape[0], virtual=True)
    check.done()
    return _tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, mailbox, peer_table,
                 ahead, axis_name=None, num_blocks=num_blocks, has_delta=has_delta, eps=eps,
                 out_eps=out_eps, two_shot=two_shot, variant=variant, backend=backend)


def _ranks(axis_name, count):
    """The ranks of a call's leading axis: this device's along `axis_name` (a mesh, one rank
    per device), or all `count` of them (virtual TP, axis_name None)."""
    if axis_name is None:
        return jnp.arange(count, dtype=jnp.int32)
    return jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)


def _tail(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, mailbox, peer_table, ahead,
          **static):
    """The one composition of the ranks' tails (x [R, B, K], w [R, H, K]; a mesh: R = 1)."""
    spec = None if mailbox is None else mailbox.spec
    table = None if mailbox is None else _table(mailbox, peer_table)
    return _tail_ranks(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table,
                       None if ahead is None else tuple(ahead), spec=spec, **static)


@functools.partial(jax.jit, static_argnames=("axis_name", "num_blocks", "has_delta", "eps",
                                             "out_eps", "spec", "two_shot", "variant",
                                             "backend"))
def _tail_ranks(x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table, ahead, *,
                axis_name, num_blocks, has_delta, eps, out_eps, spec, two_shot, variant,
                backend):
    """Each rank's (out [R, B, H], new_prefix [R, B, H]), the new blocks, and with `ahead`
    each rank's AttnResStatistics."""
    r = x.shape[0]
    if spec is not None and use_kernels(backend, prefix.shape[1]):
        from jax_kimik3.kernels import oproj

        out, new_prefix, *stats = oproj.tail(
            x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, table=table,
            ranks=_ranks(axis_name, r), spec=spec, num_blocks=num_blocks, has_delta=has_delta,
            eps=eps, out_eps=out_eps, ahead=ahead, two_shot=two_shot, variant=variant)
        return (out, new_prefix, blocks,
                *(AttnResStatistics(m, s, num_blocks, eps) for m, s in stats))
    out, new_prefix, new_blocks, *stats = _with_ahead(reference.oproj_attn_res_ranks(
        x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, axis_name=axis_name,
        num_blocks=num_blocks, has_delta=has_delta, eps=eps, out_eps=out_eps), blocks, ahead,
        num_blocks, eps)
    ranks = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (r, *a.shape)))
    return (*ranks((out, new_prefix)), new_blocks, *ranks(stats))


def _check_tail(check, x, w, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks,
                has_delta, eps, out_eps, ahead, mailbox, peer_table, two_shot, variant, backend,
                ranks, axis_name=None, virtual=False):
    """The arguments of the ranks' post-attention tail, into `check`; `ranks`: TP (the axis
    size, or the virtual shards' count), None if unknown."""
    check.flag("has_delta", has_delta)
    check_variant(check, variant, two_shot, ahead)
    rows = check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w,
                          num_blocks=num_blocks, eps=eps, out_eps=out_eps)
    if rows is not None and check.array("x", x, (rows[0], None), jnp.bfloat16):
        k = x.shape[1]
        check.array("w", w, (rows[1], k), jnp.bfloat16)
        if k < 1:
            check.fail(f"x has K={k} columns; must be >= 1")
        if rows[1] == KIMI_K3.hidden_size and ranks is not None and (
                k * ranks != KIMI_K3.o_proj_in_features):
            check.fail(f"x has K={k} columns per rank at TP={ranks}: {k * ranks} in all; "
                       f"Kimi K3's o_proj has o_proj_in_features={KIMI_K3.o_proj_in_features}")
    if ahead is not None and rows is not None:
        if not (isinstance(ahead, (tuple, list)) and len(ahead) == 2):
            check.fail(f"ahead must be a (res_norm_w, res_proj_w) pair, got {type(ahead).__name__}")
        else:
            check_weights(check, rows[1], eps, **{"ahead[0] (res_norm_w)": ahead[0],
                                                  "ahead[1] (res_proj_w)": ahead[1]})
    check_backend(check, backend, None if rows is None else rows[1])
    if mailbox is not None:
        spec = check_mailbox(check, mailbox, peer_table, axis_name=axis_name, axis_size=ranks,
                             virtual=virtual)
        if spec is not None and rows is not None:
            check_fits(check, "prefix", rows, spec, virtual=virtual, ranks=ranks)
    elif backend == "kernel":
        check.fail("backend='kernel' needs mailbox= (the all-reduce's peer buffers)")
    elif peer_table is not None:
        check.fail(f"peer_table (shape {getattr(peer_table, 'shape', None)}) is a mailbox's, "
                   "and mailbox=None: without one the tail sums by psum and would not use it")


def _with_ahead(results, blocks, ahead, num_blocks, eps):
    """The reference tail's results, with the `ahead` site's statistics if asked for."""
    if ahead is None:
        return results
    mixture, scal = reference.attn_res_statistics(blocks, *ahead, num_blocks=num_blocks, eps=eps)
    return (*results, AttnResStatistics(mixture, scal, num_blocks, eps))


def all_reduce(rows, mailbox, *, axis_name, two_shot=False, peer_table=None):
    """Sum of every TP rank's bf16 rows [B, H] through `mailbox`'s Lamport slots (in shard_map).

    One-shot: each rank receives every peer's rows; two-shot: each rank reduces the H/TP columns
    it owns and sends them back. Every rank gets bitwise-identical rows (fp32 sums in rank
    order). The buffer follows the mailbox's call counter; a wait gives up after the
    mailbox's `timeout_ms` (NaN rows, `Mailbox.check()` raises). `peer_table` as in
    `oproj_attn_res`.
    """
    check = Checker("all_reduce")
    if check.hashable(mailbox=mailbox, axis_name=axis_name, two_shot=two_shot):
        size = check_axis(check, axis_name)
        _check_reduce(check, rows, "rows", mailbox, peer_table, two_shot, axis_name=axis_name,
                      ranks=size)
    check.done()
    return _all_reduce(rows[None], _table(mailbox, peer_table), axis_name=axis_name,
                       spec=mailbox.spec, two_shot=two_shot)[0]


def all_reduce_virtual(partials, mailbox, *, two_shot=False, peer_table=None):
    """Every rank on one GPU ("virtual TP"): partials [TP, B, H] bf16 → each rank's sum
    [TP, B, H], through a `Mailbox.virtual` mailbox: the one composition `all_reduce` runs for
    one rank, for all of them (every publish, then every consumer)."""
    check = Checker("all_reduce_virtual")
    if check.hashable(mailbox=mailbox, two_shot=two_shot):
        if not hasattr(partials, "ndim") or partials.ndim != 3 or partials.shape[0] < 1:
            check.fail(f"partials has shape={getattr(partials, 'shape', partials)}; expected "
                       "[TP, B, H] with TP >= 1")
        else:
            _check_reduce(check, partials[0], "partials[r]", mailbox, peer_table, two_shot,
                          ranks=partials.shape[0], virtual=True)
    check.done()
    return _all_reduce(partials, _table(mailbox, peer_table), axis_name=None, spec=mailbox.spec,
                       two_shot=two_shot)


@functools.partial(jax.jit, static_argnames=("axis_name", "spec", "two_shot"))
def _all_reduce(partials, table, *, axis_name, spec, two_shot):
    """The one composition of the ranks' all-reduce: partials [R, B, H] (a mesh: R = 1)."""
    from jax_kimik3.kernels import lamport_ops

    return lamport_ops.all_reduce(partials, table, _ranks(axis_name, partials.shape[0]),
                                  spec=spec, two_shot=two_shot)


def _check_reduce(check, rows, name, mailbox, peer_table, two_shot, *, ranks, axis_name=None,
                  virtual=False):
    check.flag("two_shot", two_shot)
    shape = check_rows(check, name, rows)
    problem = kernel_problem()
    if problem:
        check.fail(f"the all-reduce runs on the kernels: {problem}")
    spec = check_mailbox(check, mailbox, peer_table, axis_name=axis_name, axis_size=ranks,
                         virtual=virtual)
    if spec is not None and shape is not None:
        check_fits(check, name, shape, spec, virtual=virtual, ranks=ranks, shards="partials")
