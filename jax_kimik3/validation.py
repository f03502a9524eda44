"""Trace-time checks of the public API's arguments: every problem of a call is collected and
raised as one ValueError that names each bad argument, its value and the limit."""

from __future__ import annotations

import math
import numbers
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_kimik3 import backend as backends
from jax_kimik3 import tuning
from jax_kimik3.config import KIMI_K3
from jax_kimik3.layout import MailboxSpec
from jax_kimik3.mailbox import Mailbox
from jax_kimik3.mesh_mailbox import MeshMailbox
from jax_kimik3.statistics import AttnResStatistics

CAPACITY = KIMI_K3.mailbox_capacity
EPS_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
CONCURRENT_COMMANDS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


class Checker:
    """Collects the problems of one call's arguments; `done()` raises them together."""

    def __init__(self, where: str):
        self.where, self.problems = where, []

    def fail(self, message: str):
        self.problems.append(message)

    def done(self):
        if self.problems:
            raise ValueError(f"{self.where}: " + "; ".join(self.problems))

    def array(self, name, a, shape, dtype) -> bool:
        """`a` must be an array with `shape` (None entries are free) and `dtype`."""
        want = tuple("?" if s is None else s for s in shape)
        expected = f"expected shape={want} dtype={jnp.dtype(dtype)}".replace("'?'", "?")
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            self.fail(f"{name}={_short(a)} is not an array; {expected}")
            return False
        ok = len(a.shape) == len(shape) and all(s is None or s == d
                                                for s, d in zip(shape, a.shape))
        if not ok or a.dtype != dtype:
            self.fail(f"{name} has shape={tuple(a.shape)} dtype={a.dtype}; {expected}")
            return False
        return True

    def integer(self, name, value, low=None, high=None) -> bool:
        """A Python int (not a bool) in [low, high]."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            self.fail(f"{name}={value!r} must be an integer")
            return False
        if (low is not None and value < low) or (high is not None and value > high):
            self.fail(f"{name}={value} must be in [{low}, {high}]" if high is not None
                      else f"{name}={value} must be >= {low}")
            return False
        return True

    def flag(self, name, value, optional=False) -> bool:
        if not (isinstance(value, bool) or (optional and value is None)):
            self.fail(f"{name}={value!r} must be True or False" + (" or None" if optional else ""))
            return False
        return True

    def epsilon(self, name, value):
        """A Python or NumPy number that float32 holds as a normal number > 0 (the kernels and
        the reference add it in float32: a smaller one is 0 there, and a zero row's norm
        divides by it)."""
        if (isinstance(value, bool) or not isinstance(value, (numbers.Integral, float,
                                                               np.floating))
                or not _finite(value) or not value > 0):
            self.fail(f"{name}={_short(value)} must be a finite number > 0")
        elif not EPS_RANGE[0] <= float(value) <= EPS_RANGE[1]:
            self.fail(f"{name}={_short(value)} must be in [{EPS_RANGE[0]:.8g}, "
                      f"{EPS_RANGE[1]:.8g}] (a normal float32)")

    def batch(self, name, b):
        if not 1 <= b <= CAPACITY:
            self.fail(f"{name} has batch B={b}; must be in [1, {CAPACITY}] (mailbox capacity)")

    def hashable(self, **statics) -> bool:
        """Static arguments must be hashable (jax.jit keys its compile cache by them)."""
        ok = True
        for name, value in statics.items():
            try:
                hash(value)
            except TypeError:
                self.fail(f"{name}={_short(value)} is a static argument and must be hashable "
                          f"(got an unhashable {type(value).__name__})")
                ok = False
        return ok


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value):
    """A number math.isfinite accepts and calls finite (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _as_float32(value):
    """`value` as a float32, or None where it is no real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return np.float32(value)
    except OverflowError:
        return None


def check_rows(check, name, a):
    """`a` bf16 [B, H] with 1 <= B <= CAPACITY; returns (B, H) or None."""
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        check.fail(f"{name}={_short(a)} is not an array; expected [B, H] bfloat16")
        return None
    if a.ndim != 2 or a.dtype != jnp.bfloat16:
        check.fail(f"{name} has shape={tuple(a.shape)} dtype={a.dtype}; expected [B, H] bfloat16")
        return None
    check.batch(name, a.shape[0])
    if a.shape[1] < 1:
        check.fail(f"{name} has H={a.shape[1]}; must be >= 1")
        return None
    return a.shape


def check_blocks(check, blocks, *, num_blocks, write_idx=-1, rows=None):
    """blocks bf16 [B, NB, H] (B, H from `rows` when given); K and the write within NB.

    Returns (B, H), or None when the shape is unusable.
    """
    want = (None, None, None) if rows is None else (rows[0], None, rows[1])
    if not check.array("blocks", blocks, want, jnp.bfloat16):
        return None
    b, nb, h = blocks.shape
    check.batch("blocks", b)
    if not check.integer("write_idx", write_idx):
        return b, h
    if check.integer("num_blocks", num_blocks):
        if not 0 <= num_blocks <= nb:
            check.fail(f"num_blocks={num_blocks} must be in [0, NB={nb}] (blocks.shape[1])")
        elif write_idx != -1 and not num_blocks <= write_idx < nb:
            check.fail(f"write_idx={write_idx} must be -1 or in [num_blocks={num_blocks}, "
                       f"NB={nb})")
    return b, h


def check_weights(check, h, eps, **weights):
    """Each named weight bf16 [H] (a required one may not be None); eps a finite number > 0.
    Name a weight `out_norm_w` to allow None (the call returns the mix)."""
    for name, w in weights.items():
        if w is None and name.startswith("out_norm_w"):
            continue
        if w is None:
            check.fail(f"{name}=None: a bf16 [{h}] weight is required")
        else:
            check.array(name, w, (h,), jnp.bfloat16)
    check.epsilon("eps", eps)


def check_statistics(check, stats, rows, num_blocks, eps):
    """`stats` from `attn_res_statistics` for the same rows, `num_blocks` and `eps`."""
    if not isinstance(stats, AttnResStatistics):
        check.fail(f"stats={_short(stats)} must be the AttnResStatistics that "
                   "attn_res_statistics (or oproj_attn_res(ahead=)) returns: it records "
                   "the num_blocks it covers")
        return
    b, h = rows
    check.array("stats.mixture", stats.mixture, (b, h), jnp.float32)
    check.array("stats.scal", stats.scal, (b, 2), jnp.float32)
    if stats.num_blocks != num_blocks:
        check.fail(f"stats cover num_blocks={stats.num_blocks!r} saved blocks; this call mixes "
                   f"num_blocks={num_blocks!r}")
    if _as_float32(stats.eps) is None:
        check.fail(f"stats.eps={stats.eps!r} must be the number attn_res_statistics took")
    elif _as_float32(eps) is not None and _as_float32(stats.eps) != _as_float32(eps):
        check.fail(f"stats were taken with eps={stats.eps!r}; this call normalises the "
                   f"saved blocks with eps={eps!r}")


def check_attn_res(check, prefix, blocks, res_norm_w, res_proj_w, out_norm_w, *, num_blocks,
                   eps, out_eps, delta=None, write_idx=-1, stats=None):
    """Every `attn_res` argument; returns (B, H) or None."""
    check.epsilon("out_eps", out_eps)
    rows = check_rows(check, "prefix", prefix)
    if rows is None:
        check.epsilon("eps", eps)
        return None
    b, h = rows
    check_blocks(check, blocks, num_blocks=num_blocks, write_idx=write_idx, rows=rows)
    check_weights(check, h, eps, res_norm_w=res_norm_w, res_proj_w=res_proj_w,
                  out_norm_w=out_norm_w)
    if delta is not None:
        check.array("delta", delta, (b, h), jnp.bfloat16)
    if stats is not None:
        check_statistics(check, stats, rows, num_blocks, eps)
    return rows


def check_backend_name(check, backend) -> bool:
    """A known backend (what it needs of the host is check_backend's)."""
    if backend in backends.BACKENDS:
        return True
    check.fail(f"backend={backend!r} must be one of {backends.BACKENDS}")
    return False


def check_backend(check, backend, hidden=None):
    """A known backend; "kernel" needs a CUDA GPU, or a kernel target to lower for."""
    if not check_backend_name(check, backend):
        return
    if backend == "kernel":
        problem = backends.kernel_problem(hidden)
        if problem:
            check.fail(f"backend='kernel': {problem}")


def check_variant(check, variant, two_shot, ahead=None):
    """The tail's `two_shot` (True, False or None) and `variant` (None or a tuning name);
    "fused" is one-shot and computes no statistics `ahead`."""
    check.flag("two_shot", two_shot, optional=True)
    if variant is not None and variant not in tuning.TAIL_VARIANT_NAMES:
        check.fail(f"variant={variant!r} must be None or one of {tuning.TAIL_VARIANT_NAMES}")
    elif variant == "fused" and (two_shot or ahead is not None):
        check.fail(f"variant='fused' is one-shot without statistics ahead; got "
                   f"two_shot={two_shot!r}, ahead={'None' if ahead is None else '(...)'}")


def axis_names(axis_name) -> tuple:
    """`axis_name` (a mesh axis name, or a tuple of them) as a tuple of names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_axis(check, axis_name):
    """`axis_name` (a mesh axis name, or a tuple of distinct ones) bound by the enclosing
    shard_map: its size, or None."""
    if not check.hashable(axis_name=axis_name):
        return None
    names = axis_names(axis_name)
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) < len(names):
        check.fail(f"axis_name={axis_name!r} must be a mesh axis name or a tuple of distinct "
                   "ones (the TP axis)")
        return None
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        check.fail(f"axis_name={axis_name!r} is not bound: call inside shard_map (or jax.jit "
                   "of it) over a mesh with that axis")
    return None


def check_mailbox_kind(check, mailbox) -> bool:
    """A Mailbox, a MeshMailbox or a MailboxSpec (where the caller allows None, it checks
    that first)."""
    if isinstance(mailbox, (Mailbox, MeshMailbox, MailboxSpec)):
        return True
    check.fail(f"mailbox={_short(mailbox)} must be a Mailbox, a MeshMailbox, a MailboxSpec or "
               "None")
    return False


def check_mailbox(check, mailbox, peer_table, *, axis_name=None, axis_size=None,
                  virtual=False):
    """A live Mailbox, a MeshMailbox or a MailboxSpec that fits the call: under shard_map one
    rank per device of `axis_name`, and as many groups as the mesh's other axes make; in
    virtual TP (`virtual`) every rank's buffer on the one device. `peer_table` (uint32
    [T + 1, 2], or a device's block [1, ..., 1, T + 1, 2] of MeshMailbox.table) is required
    but for a live Mailbox, whose own table is then a constant. Returns its spec or None."""
    if not check_mailbox_kind(check, mailbox):
        return None
    spec = mailbox.spec
    if isinstance(mailbox, (Mailbox, MeshMailbox)) and mailbox.closed:
        check.fail(f"mailbox={mailbox!r} is closed")
    if peer_table is not None:  # a MeshMailbox's: exactly one block of its table
        lead = (mailbox.mesh.devices.ndim if isinstance(mailbox, MeshMailbox)
                else max(len(getattr(peer_table, "shape", ())) - 2, 0))
        check.array("peer_table", peer_table, (1,) * lead + (spec.tp + 1, 2), jnp.uint32)
    elif isinstance(mailbox, MeshMailbox):
        check.fail(f"mailbox={mailbox!r} has a peer table per device: pass peer_table= (its "
                   "`table`, given to shard_map with in_specs `table_spec`)")
    elif not isinstance(mailbox, Mailbox):
        check.fail(f"mailbox={mailbox!r} has no memory: pass its peer_table= (uint32 "
                   f"[{spec.tp + 1}, 2], Mailbox.peer_table of the live mailbox)")
    if CONCURRENT_COMMANDS in os.environ.get("XLA_FLAGS", ""):
        check.fail(f"XLA_FLAGS has {CONCURRENT_COMMANDS}: XLA could then run two mailbox "
                   "calls at once, and a mailbox's calls must follow one another")
    if jax.process_count() > 1 and isinstance(mailbox, Mailbox) and peer_table is None:
        check.fail(f"this program runs on {jax.process_count()} processes, and mailbox="
                   f"{mailbox!r} without peer_table= would bake this process's buffer "
                   "addresses into it: use a MeshMailbox, whose per-device peer table is an "
                   "operand")
    if virtual:
        if not spec.virtual and spec.tp > 1:
            check.fail(f"mailbox={mailbox!r} has its {spec.tp} ranks on different devices; "
                       "virtual TP runs every rank on one device: Mailbox.virtual(device, tp)")
        return spec
    if axis_size is None:
        return spec
    if spec.virtual:
        check.fail(f"mailbox={mailbox!r} is virtual (every rank's buffer on one device) and "
                   f"cannot serve mesh axis {axis_name!r}: use MeshMailbox(mesh, axis_name) "
                   "or the *_virtual calls")
    if axis_size != spec.tp:
        check.fail(f"axis {axis_name!r} has {axis_size} ranks; the mailbox has tp={spec.tp}")
    mesh = jax.sharding.get_abstract_mesh()
    names = axis_names(axis_name)
    if isinstance(mailbox, MeshMailbox):
        if names != (mailbox.axis_name,):
            check.fail(f"axis_name={axis_name!r}, but the mailbox's groups run along axis "
                       f"{mailbox.axis_name!r}")
        here = tuple(zip(mesh.axis_names, mesh.axis_sizes))
        made = tuple(zip(mailbox.mesh.axis_names, mailbox.mesh.axis_sizes))
        if here != made:
            check.fail(f"the mesh here has axes {dict(here)}; the mailbox was made for the "
                       f"mesh {dict(made)}")
    others = {n: s for n, s in zip(mesh.axis_names, mesh.axis_sizes) if n not in names and s > 1}
    groups = math.prod(others.values())
    if groups != spec.groups:
        if spec.groups == 1:
            check.fail(f"the mesh has other axes {others} beside {axis_name!r}: each of their "
                       f"{groups} groups of {axis_size} ranks would share the one mailbox's "
                       "buffers (a Mailbox serves one TP group): use MeshMailbox(mesh, "
                       f"{axis_name!r}), one mailbox per group")
        else:
            check.fail(f"the mesh's other axes {others} make {groups} groups of "
                       f"{axis_name!r}; the mailbox serves groups={spec.groups}")
    return spec


def check_fits(check, name, shape, spec, *, virtual=False, ranks=None, shards="x"):
    """Rows of `shape` (B, H), already checked against CAPACITY (every mailbox's), fit the
    mailbox of `spec`; in virtual TP its tp is the `ranks` of the `shards` argument."""
    if shape[1] != spec.layout.hidden:
        check.fail(f"{name} has H={shape[1]}; the mailbox's rows have hidden={spec.layout.hidden}")
    if virtual and ranks != spec.tp:
        check.fail(f"{shards} has TP={ranks} shards; the mailbox has tp={spec.tp}")
