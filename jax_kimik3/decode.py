"""The canonical Kimi K3 decode step over the attention tails, at model sizes: what
`examples/decode_loop.py` runs and what the kernel library's catalog traces.

Per layer: the pre-attention AttnRes (with its block write), a stand-in for attention (a
fixed projection H -> 12288, split over the TP ranks like attention heads), the
post-attention tail `oproj_attn_res` (o_proj + all-reduce + AttnRes), and a stand-in for the
MLP (a fixed projection H -> H) whose output is the next layer's delta; the final AttnRes
closes the step. The stand-ins keep the step's data flow (and its kernel calls) those of the
model without its attention or experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kimik3.config import KIMI_K3, check_int
from jax_kimik3.layer import AttentionTail, AttnResWeights, final_attn_res
from jax_kimik3.mesh_mailbox import table_spec

H, K = KIMI_K3.hidden_size, KIMI_K3.o_proj_in_features
AXIS = "tp"
DATA_AXIS = "dp"  # a mesh ("dp", "tp"): each data-parallel group its own rows and TP mailbox


def check_virtual_tp(virtual_tp):
    """None, or a TP that splits o_proj's K into whole shards."""
    if virtual_tp is not None:
        KIMI_K3.o_proj_local_features(virtual_tp, "virtual_tp")
    return virtual_tp


def _check_mesh(mesh):
    """A mesh with the TP axis AXIS, along which the step splits o_proj's K."""
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh has axes {dict(zip(mesh.axis_names, mesh.axis_sizes))}; the "
                         f"step needs a {AXIS!r} axis (tensor parallel, o_proj split along it)")


def _check_layers(num_layers, virtual_tp):
    """Refuse a layer count outside 1..KIMI_K3.num_layers or a virtual TP no o_proj split has."""
    check_int("num_layers", num_layers, 1, KIMI_K3.num_layers)
    check_virtual_tp(virtual_tp)


def param_shapes(num_layers, virtual_tp=None):
    """The step's parameters as ShapeDtypeStructs (bf16): what `init_params` makes."""
    _check_layers(num_layers, virtual_tp)
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    site = AttnResWeights(s((H,)), s((H,)), s((H,)))
    o_proj = s((virtual_tp, H, K // virtual_tp)) if virtual_tp else s((H, K))
    return {"attention": s((H, K)), "mlp": s((H, H)), "final": site,
            "layers": [{"pre": site, "post": site, "o_proj": o_proj}
                       for _ in range(num_layers)]}


def init_params(key, mesh, num_layers, virtual_tp=None):
    """Random weights, created on `mesh`: o_proj and the attention stand-in split along K
    (with `virtual_tp`, o_proj held as the ranks' shards [TP, H, K/TP] on the one device)."""
    _check_layers(num_layers, virtual_tp)
    _check_mesh(mesh)
    split = NamedSharding(mesh, P(None, AXIS))
    whole = NamedSharding(mesh, P())

    @functools.cache  # one compile per kind of weight, not per weight
    def maker(shape, scale, sharding):
        return jax.jit(lambda k: (scale * jax.random.normal(k, shape, jnp.float32))
                       .astype(jnp.bfloat16), out_shardings=sharding)

    def normal(key, shape, scale, sharding):
        return maker(shape, scale, sharding)(key)

    def site(key):
        g, w, o = jax.random.split(key, 3)
        return AttnResWeights(res_norm_w=1 + normal(g, (H,), 0.2, whole),
                              res_proj_w=normal(w, (H,), 4.0 / np.sqrt(H), whole),
                              out_norm_w=1 + normal(o, (H,), 0.2, whole))

    keys = jax.random.split(key, 4 + 3 * num_layers)
    layers = []
    for i in range(num_layers):
        pre, post, o_proj = keys[4 + 3 * i: 7 + 3 * i]
        w = normal(o_proj, (H, K), 1 / np.sqrt(K), split)
        if virtual_tp:
            w = jnp.moveaxis(w.reshape(H, virtual_tp, K // virtual_tp), 1, 0)
        layers.append({"pre": site(pre), "post": site(post), "o_proj": w})
    return {
        "attention": normal(keys[0], (H, K), 1 / np.sqrt(H), split),  # stand-in, shared
        "mlp": normal(keys[1], (H, H), 0.5 / np.sqrt(H), whole),  # stand-in, shared
        "final": site(keys[2]),
        "layers": layers,
    }


def param_specs(params):
    """shard_map specs: arrays of width K are split along K, all else replicated."""
    return jax.tree.map(lambda a: P(None, AXIS) if a.shape == (H, K) else P(), params)


def rows_spec(mesh):
    """shard_map spec of the step's rows (embedding, blocks, output): split over DATA_AXIS
    where the mesh has one, else whole on every device."""
    return P(DATA_AXIS) if DATA_AXIS in mesh.axis_names else P()


def table_shape(mesh, tp):
    """The step's peer table operand on `mesh` (a MeshMailbox's `table`): one [tp + 1, 2]
    block per device."""
    return jax.ShapeDtypeStruct((*mesh.axis_sizes, tp + 1, 2), jnp.uint32)


def decode_step(params, embedding, blocks, table, *, num_layers, backend, mailbox,
                stats_ahead=False, virtual_tp=None, two_shot=None, variant=None):
    """One decode step through `num_layers` layers and the final AttnRes (inside shard_map
    over AXIS and, where the mesh has it, DATA_AXIS); `mailbox` is a MailboxSpec (kernels) or
    None, `table` its peer table operand (this device's block).
    With `stats_ahead`, layer i's post-attention tail also returns the statistics of the
    saved blocks for the next call site (layer i + 1's pre-attention, or the final AttnRes).
    With `virtual_tp` (a mesh of one device) the tail runs that many ranks on the device.
    `two_shot` and `variant` override the measured table in every post-attention tail.
    Returns (out [B, H], blocks [B, NB, H])."""
    layers = params["layers"]
    if check_int("num_layers", num_layers, 1, KIMI_K3.num_layers) > len(layers):
        raise ValueError(f"num_layers={num_layers}, but params has {len(layers)} layers")
    check_virtual_tp(virtual_tp)
    tails = [AttentionTail(KIMI_K3.layer(i), axis_name=AXIS, mailbox=mailbox, backend=backend,
                           two_shot=two_shot, variant=variant)
             for i in range(num_layers)]
    prefix, delta, stats = embedding, None, None  # layer 0's pre-attention mixes no block
    for i, tail in enumerate(tails):
        layer = layers[i]
        hidden, prefix, blocks = tail.pre_attention(layer["pre"], prefix, blocks, delta, stats)
        x = jnp.dot(hidden, params["attention"]).astype(jnp.bfloat16)  # this rank's heads
        post = tail.post_attention
        if virtual_tp:  # [B, K] → the ranks' shards [TP, B, K/TP]
            x = jnp.moveaxis(x.reshape(x.shape[0], virtual_tp, -1), 1, 0)
            post = tail.post_attention_virtual
        following = layers[i + 1]["pre"] if i + 1 < num_layers else params["final"]
        results = post(layer["post"], x, layer["o_proj"], prefix, blocks, peer_table=table,
                       ahead=following if stats_ahead else None)
        hidden, prefix, blocks = results[:3]
        stats = results[3] if stats_ahead else None
        delta = jnp.dot(hidden, params["mlp"]).astype(jnp.bfloat16)
    out = final_attn_res(params["final"], prefix, blocks, delta, stats=stats,
                         num_layers=num_layers, backend=backend)
    return out, blocks


def make_step(mesh, params, num_layers, backend, mailbox, stats_ahead=False, virtual_tp=None,
              two_shot=None, variant=None):
    """The jitted step(params, embedding, blocks, table) -> (out, blocks) on `mesh` (a Mesh,
    or an AbstractMesh to trace it; with `virtual_tp`, on its one device: no shard_map).
    `table`: None for the reference, else of `table_shape(mesh, tp)` (a MeshMailbox's table;
    in virtual TP the mailbox's own [tp + 1, 2]). `two_shot`, `variant`: as in `decode_step`."""
    def step(p, e, b, t):
        return decode_step(p, e, b, t, num_layers=num_layers, backend=backend, mailbox=mailbox,
                           stats_ahead=stats_ahead, virtual_tp=virtual_tp, two_shot=two_shot,
                           variant=variant)

    _check_mesh(mesh)
    if virtual_tp:
        return jax.jit(step)
    rows = rows_spec(mesh)
    return jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(param_specs(params), rows, rows, table_spec(mesh)),
        out_specs=(rows, rows)))
