"""Bad input raises a ValueError at trace time naming the argument, its value and the limit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3

H, NB = 256, 8
bf16 = jnp.bfloat16


def spec(shape, dtype=bf16):
    return jax.ShapeDtypeStruct(shape, dtype)


def attn_args(b=4, h=H, nb=NB):
    return dict(prefix=spec((b, h)), blocks=spec((b, nb, h)), res_norm_w=spec((h,)),
                res_proj_w=spec((h,)), out_norm_w=spec((h,)))


def trace_attn_res(args, **static):
    """Traces only: the errors must come at trace time, before anything runs."""
    def f(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, delta=None, stats=None):
        return k3.attn_res(prefix, blocks, res_norm_w, res_proj_w, out_norm_w, delta=delta,
                           stats=stats, **static)
    return jax.jit(f).trace(**args)


ATTN_RES_CASES = [
    ("batch too large", dict(prefix=spec((65, H)), blocks=spec((65, NB, H))), {},
     r"prefix has batch B=65; must be in \[1, 64\]"),
    ("prefix dtype", dict(prefix=spec((4, H), jnp.float32)), {},
     r"prefix has shape=\(4, 256\) dtype=float32; expected \[B, H\] bfloat16"),
    ("prefix rank", dict(prefix=spec((4, 2, H))), {}, r"prefix has shape=\(4, 2, 256\)"),
    ("blocks shape", dict(blocks=spec((4, NB, H + 8))), {},
     r"blocks has shape=\(4, 8, 264\) dtype=bfloat16; expected shape=\(4, \?, 256\)"),
    ("blocks dtype", dict(blocks=spec((4, NB, H), jnp.float16)), {},
     r"blocks has .* dtype=float16; expected .* dtype=bfloat16"),
    ("num_blocks > NB", {}, dict(num_blocks=9), r"num_blocks=9 must be in \[0, NB=8\]"),
    ("num_blocks < 0", {}, dict(num_blocks=-1), r"num_blocks=-1 must be in \[0, NB=8\]"),
    ("write_idx >= NB", {}, dict(num_blocks=2, write_idx=8),
     r"write_idx=8 must be -1 or in \[num_blocks=2, NB=8\)"),
    ("write_idx < num_blocks", {}, dict(num_blocks=3, write_idx=1),
     r"write_idx=1 must be -1 or in \[num_blocks=3, NB=8\)"),
    ("write_idx < -1", {}, dict(num_blocks=0, write_idx=-2), r"write_idx=-2 must be -1 or in"),
    ("weight shape", dict(res_proj_w=spec((1, H))), {},
     r"res_proj_w has shape=\(1, 256\) dtype=bfloat16; expected shape=\(256,\)"),
    ("out weight dtype", dict(out_norm_w=spec((H,), jnp.float32)), {},
     r"out_norm_w has shape=\(256,\) dtype=float32; expected shape=\(256,\) dtype=bfloat16"),
    ("delta shape", dict(delta=spec((3, H))), {},
     r"delta has shape=\(3, 256\) dtype=bfloat16; expected shape=\(4, 256\)"),
    ("stats dtype", dict(stats=(spec((4, H)), spec((4, 2), jnp.float32))), {},
     r"stats\[0\] \(mixture\) has shape=\(4, 256\) dtype=bfloat16; expected .* dtype=float32"),
    ("stats shape", dict(stats=(spec((4, H), jnp.float32), spec((4, 3), jnp.float32))), {},
     r"stats\[1\] \(scal\) has shape=\(4, 3\)"),
    ("eps", {}, dict(eps=0.0), r"eps=0.0 must be > 0"),
    ("out_eps", {}, dict(out_eps=-1e-5), r"out_eps=-1e-05 must be > 0"),
]


@pytest.mark.parametrize("case", ATTN_RES_CASES, ids=[c[0] for c in ATTN_RES_CASES])
def test_attn_res_rejects(case):
    _, overrides, static, pattern = case
    static = dict(num_blocks=static.pop("num_blocks", 2), **static)
    with pytest.raises(ValueError, match=r"^attn_res: .*" + pattern):
        trace_attn_res({**attn_args(), **overrides}, **static)


def test_every_problem_is_reported_at_once():
    args = {**attn_args(), "res_norm_w": spec((H + 1,))}
    with pytest.raises(ValueError, match=r"num_blocks=9 must be .*; res_norm_w has shape=\(257,\)"):
        trace_attn_res(args, num_blocks=9, eps=1e-5)


def test_valid_arguments_trace():
    trace_attn_res(attn_args(), num_blocks=8)
    trace_attn_res({**attn_args(), "out_norm_w": None}, num_blocks=4, write_idx=7)


@pytest.mark.parametrize("blocks,num_blocks,pattern", [
    (spec((65, NB, H)), 2, r"blocks has batch B=65; must be in \[1, 64\]"),
    (spec((4, NB, H)), 9, r"num_blocks=9 must be in \[0, NB=8\]"),
    (spec((4, H)), 2, r"blocks has shape=\(4, 256\) dtype=bfloat16; expected shape=\(\?, \?, \?\)"),
])
def test_statistics_rejects(blocks, num_blocks, pattern):
    with pytest.raises(ValueError, match=r"^attn_res_statistics: .*" + pattern):
        jax.jit(lambda b, g, w: k3.attn_res_statistics(b, g, w, num_blocks=num_blocks)).trace(
            blocks, spec((H,)), spec((H,)))


@pytest.mark.parametrize("x,w,pattern", [
    (spec((4, 96)), spec((H, 64)),
     r"w has shape=\(256, 64\) dtype=bfloat16; expected shape=\(256, 96\)"),
    (spec((5, 96)), spec((H, 96)), r"x has shape=\(5, 96\) dtype=bfloat16; expected shape=\(4, \?\)"),
    (spec((4, 96), jnp.float32), spec((H, 96)), r"x has .* dtype=float32"),
])
def test_oproj_attn_res_rejects(x, w, pattern):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    step = jax.shard_map(
        lambda *a: k3.oproj_attn_res(*a, axis_name="tp", num_blocks=2, has_delta=True),
        mesh=mesh, in_specs=(P(), P()) + (P(),) * 5, out_specs=P())
    args = attn_args()
    with pytest.raises(ValueError, match=r"^oproj_attn_res: .*" + pattern):
        jax.jit(step).trace(x, w, *args.values())


@pytest.mark.parametrize("ahead,pattern", [
    ((spec((H,)),), r"ahead must be a \(res_norm_w, res_proj_w\) pair, got tuple"),
    ((spec((H,)), spec((H + 1,))),
     r"ahead\[1\] \(res_proj_w\) has shape=\(257,\) dtype=bfloat16; expected shape=\(256,\)"),
])
def test_oproj_attn_res_rejects_ahead(ahead, pattern):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    step = jax.shard_map(
        lambda *a: k3.oproj_attn_res(*a, axis_name="tp", num_blocks=2, has_delta=True,
                                     ahead=ahead),
        mesh=mesh, in_specs=(P(), P()) + (P(),) * 5, out_specs=P())
    with pytest.raises(ValueError, match=r"^oproj_attn_res: .*" + pattern):
        jax.jit(step).trace(spec((4, 96)), spec((H, 96)), *attn_args().values())


@pytest.mark.parametrize("x,w,pattern", [
    (spec((4, 96)), spec((H, 96)), r"x has shape=\(4, 96\) and w shape=\(256, 96\); expected "
                                   r"\[TP, B, K/TP\] and \[TP, H, K/TP\]"),
    (spec((2, 4, 48)), spec((2, H, 40)),
     r"w has shape=\(256, 40\) dtype=bfloat16; expected shape=\(256, 48\)"),
])
def test_oproj_attn_res_virtual_rejects(x, w, pattern):
    with pytest.raises(ValueError, match=r"^oproj_attn_res_virtual: .*" + pattern):
        jax.jit(lambda *a: k3.oproj_attn_res_virtual(*a, num_blocks=2, has_delta=True)).trace(
            x, w, *attn_args().values())
