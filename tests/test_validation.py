"""Bad input raises a ValueError at trace time naming the argument, its value and the limit."""

import fractions
import functools
import os
import warnings

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
    ("stats dtype", dict(stats=k3.AttnResStatistics(spec((4, H)), spec((4, 2), jnp.float32), 2)),
     {}, r"stats.mixture has shape=\(4, 256\) dtype=bfloat16; expected .* dtype=float32"),
    ("stats shape", dict(stats=k3.AttnResStatistics(spec((4, H), jnp.float32),
                                                    spec((4, 3), jnp.float32), 2)), {},
     r"stats.scal has shape=\(4, 3\)"),
    ("stats of other K", dict(stats=k3.AttnResStatistics(spec((4, H), jnp.float32),
                                                         spec((4, 2), jnp.float32), 3)), {},
     r"stats cover num_blocks=3 saved blocks; this call mixes num_blocks=2"),
    ("stats a plain pair", dict(stats=(spec((4, H), jnp.float32), spec((4, 2), jnp.float32))),
     {}, r"stats=\(.* must be the AttnResStatistics that attn_res_statistics"),
    ("eps", {}, dict(eps=0.0), r"eps=0.0 must be a finite number > 0"),
    ("eps nan", {}, dict(eps=float("nan")), r"eps=nan must be a finite number > 0"),
    ("eps inf", {}, dict(eps=float("inf")), r"eps=inf must be a finite number > 0"),
    ("eps bool", {}, dict(eps=True), r"eps=True must be a finite number > 0"),
    ("eps str", {}, dict(eps="1e-5"), r"eps='1e-5' must be a finite number > 0"),
    ("out_eps", {}, dict(out_eps=-1e-5), r"out_eps=-1e-05 must be a finite number > 0"),
    ("eps float32 zero", {}, dict(eps=1e-38),
     r"eps=1e-38 must be in \[1.1754944e-38, 3.4028235e\+38\] \(a normal float32\)"),
    ("out_eps float32 zero", {}, dict(out_eps=1e-50), r"out_eps=1e-50 must be in \[1.17"),
    ("eps float32 inf", {}, dict(eps=1e39), r"eps=1e\+39 must be in \[1.17"),
    ("eps fraction", {}, dict(eps=fractions.Fraction(1, 100000)),
     r"eps=Fraction\(1, 100000\) must be a finite number > 0"),
    ("stats of other eps", dict(stats=k3.AttnResStatistics(spec((4, H), jnp.float32),
                                                           spec((4, 2), jnp.float32), 2, 1.0)),
     {}, r"stats were taken with eps=1.0; this call normalises the saved blocks with eps=1e-05"),
    ("num_blocks float", {}, dict(num_blocks=2.0), r"num_blocks=2.0 must be an integer"),
    ("num_blocks bool", {}, dict(num_blocks=True), r"num_blocks=True must be an integer"),
    ("write_idx float", {}, dict(num_blocks=2, write_idx=3.0), r"write_idx=3.0 must be an integer"),
    ("res_norm_w None", dict(res_norm_w=None), {},
     r"res_norm_w=None: a bf16 \[256\] weight is required"),
    ("res_proj_w None", dict(res_proj_w=None), {},
     r"res_proj_w=None: a bf16 \[256\] weight is required"),
    ("weight not an array", dict(res_proj_w=[1.0] * H), {},
     r"res_proj_w=\[.* is not an array; expected shape=\(256,\) dtype=bfloat16"),
    ("prefix None", dict(prefix=None), {}, r"prefix=None is not an array; expected \[B, H\]"),
    ("blocks None", dict(blocks=None), {}, r"blocks=None is not an array"),
    ("unhashable num_blocks", {}, dict(num_blocks=[2]),
     r"num_blocks=\[2\] is a static argument and must be hashable \(got an unhashable list\)"),
    ("backend", {}, dict(backend="gpu"), r"backend='gpu' must be one of \('auto', 'kernel'"),
    ("eps past float", {}, dict(eps=10**400), r"eps=10{56}\.\.\. must be a finite number > 0"),
    ("eps str with stats", dict(stats=k3.AttnResStatistics(spec((4, H), jnp.float32),
                                                           spec((4, 2), jnp.float32), 2)),
     dict(eps="abc"), r"eps='abc' must be a finite number > 0"),
    ("stats eps no number", dict(stats=k3.AttnResStatistics(spec((4, H), jnp.float32),
                                                            spec((4, 2), jnp.float32), 2, "x")),
     {}, r"stats.eps='x' must be the number attn_res_statistics took"),
    ("no hidden", attn_args(h=0), {}, r"prefix has H=0; must be >= 1"),
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
    trace_attn_res(attn_args(), num_blocks=2, eps=np.float32(1e-6), out_eps=1)
    with warnings.catch_warnings():  # a float16 eps is held against float32's range quietly
        warnings.simplefilter("error")
        trace_attn_res(attn_args(), num_blocks=2, eps=np.float16(1e-5))


def test_statistics_carry_their_eps(rng):
    """Statistics mix only into a call of the same eps; they keep it through jax.jit and
    through an exported function's serialized result tree."""
    blocks = jnp.asarray(rng.standard_normal((4, NB, H)), bf16)
    g, w = (jnp.asarray(1 + 0.1 * rng.standard_normal(H), bf16) for _ in range(2))
    take = jax.jit(lambda b: k3.attn_res_statistics(b, g, w, num_blocks=2, eps=1e-3))
    stats = take(blocks)
    assert (stats.num_blocks, stats.eps) == (2, 1e-3)
    exported = jax.export.deserialize(jax.export.export(take)(blocks).serialize())
    assert (exported.call(blocks).num_blocks, exported.call(blocks).eps) == (2, 1e-3)
    prefix = jnp.asarray(rng.standard_normal((4, H)), bf16)
    with_stats = k3.attn_res(prefix, blocks, g, w, g, num_blocks=2, eps=1e-3, stats=stats)[0]
    without = k3.attn_res(prefix, blocks, g, w, g, num_blocks=2, eps=1e-3)[0]
    np.testing.assert_allclose(np.float32(with_stats), np.float32(without), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"stats were taken with eps=0.001; this call "
                                         r"normalises the saved blocks with eps=1e-05"):
        k3.attn_res(prefix, blocks, g, w, g, num_blocks=2, stats=stats)


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
    (spec((0, 4, 48)), spec((0, H, 48)), r"x has shape=\(0, 4, 48\) .* with TP >= 1"),
    (spec((2, 4, 0)), spec((2, H, 0)), r"x has K=0 columns; must be >= 1"),
])
def test_oproj_attn_res_virtual_rejects(x, w, pattern):
    with pytest.raises(ValueError, match=r"^oproj_attn_res_virtual: .*" + pattern):
        jax.jit(lambda *a: k3.oproj_attn_res_virtual(*a, num_blocks=2, has_delta=True)).trace(
            x, w, *attn_args().values())



def on_mesh(f, tp=2, axes=("tp",), shape=None):
    mesh = Mesh(np.array(jax.devices()[:tp]).reshape(shape or (tp,)), axes)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))


def tail_trace(tp=2, x=None, w=None, axis_name="tp", **static):
    """oproj_attn_res traced on a TP mesh of host devices with the reference's small H."""
    x = spec((4, 96)) if x is None else x
    w = spec((H, 96)) if w is None else w
    static = dict(dict(num_blocks=2, has_delta=True), **static)
    step = on_mesh(lambda *a: k3.oproj_attn_res(*a, axis_name=axis_name, **static), tp)
    return step.trace(x, w, *attn_args().values())


TAIL_CASES = [
    ("has_delta None", dict(has_delta=None), r"has_delta=None must be True or False"),
    ("has_delta int", dict(has_delta=1), r"has_delta=1 must be True or False"),
    ("two_shot str", dict(two_shot="no"), r"two_shot='no' must be True or False or None"),
    ("variant unknown", dict(variant="two_shot"),
     r"variant='two_shot' must be None or one of \('fused', 'split', 'xla'\)"),
    ("fused two-shot", dict(variant="fused", two_shot=True),
     r"variant='fused' is one-shot without statistics ahead; got two_shot=True, ahead=None"),
    ("fused ahead", dict(variant="fused", ahead=(spec((H,)), spec((H,)))),
     r"variant='fused' is one-shot without statistics ahead; got two_shot=None, ahead=\(\.\.\.\)"),
    ("num_blocks float", dict(num_blocks=2.0), r"num_blocks=2.0 must be an integer"),
    ("eps zero", dict(eps=0), r"eps=0 must be a finite number > 0"),
    ("out_eps nan", dict(out_eps=float("nan")), r"out_eps=nan must be a finite number > 0"),
    ("unbound axis", dict(axis_name="model"),
     r"axis_name='model' is not bound: call inside shard_map"),
    ("empty axis tuple", dict(axis_name=()),
     r"axis_name=\(\) must be a mesh axis name or a tuple of distinct ones"),
    ("repeated axis", dict(axis_name=("tp", "tp")), r"axis_name=\('tp', 'tp'\) must be a mesh"),
    ("axis position", dict(axis_name=0), r"axis_name=0 must be a mesh axis name"),
    ("unhashable axis", dict(axis_name=["tp"]),
     r"axis_name=\['tp'\] is a static argument and must be hashable"),
    ("mailbox type", dict(mailbox="box"), r"mailbox='box' must be a Mailbox, a MeshMailbox, a MailboxSpec or None"),
    ("unhashable mailbox", dict(mailbox={}), r"mailbox=\{\} is a static argument and must be hashable"),
    ("kernel without mailbox", dict(backend="kernel"),
     r"backend='kernel' needs mailbox= \(the all-reduce's peer buffers\)"),
    ("ahead of one", dict(ahead=(spec((H,)),)), r"ahead must be a \(res_norm_w, res_proj_w\) pair"),
    ("ahead None weight", dict(ahead=(spec((H,)), None)),
     r"ahead\[1\] \(res_proj_w\)=None: a bf16 \[256\] weight is required"),
    ("peer table without mailbox", dict(peer_table=np.zeros((3, 2), np.uint32)),
     r"peer_table \(shape \(3, 2\)\) is a mailbox's, and mailbox=None"),
]


@pytest.mark.parametrize("case", TAIL_CASES, ids=[c[0] for c in TAIL_CASES])
def test_oproj_attn_res_rejects_statics(case):
    _, static, pattern = case
    with pytest.raises(ValueError, match=r"^oproj_attn_res: .*" + pattern):
        tail_trace(**static)


def kimi_tail_trace(tp, k, mailbox=None, peer_table=None, shape=None, axes=("tp",),
                    axis_name="tp", **static):
    """oproj_attn_res at Kimi K3's H on a mesh of host devices (traced, nothing runs)."""
    h = 7168
    args = [spec((4, k)), spec((h, k)), spec((4, h)), spec((4, NB, h)), spec((h,)), spec((h,)),
            spec((h,))]
    f = functools.partial(k3.oproj_attn_res, axis_name=axis_name, num_blocks=2, has_delta=True,
                          mailbox=mailbox, **static)
    if peer_table is not None:
        args.append(peer_table)
        f = (lambda g: lambda *a: g(*a[:-1], peer_table=a[-1]))(f)
    return on_mesh(f, tp, axes, shape).trace(*args)


def test_oproj_shards_must_add_up_to_the_config():
    with pytest.raises(ValueError, match=r"x has K=1024 columns per rank at TP=2: 2048 in all; "
                                         r"Kimi K3's o_proj has o_proj_in_features=12288"):
        kimi_tail_trace(2, 1024)
    kimi_tail_trace(2, 6144)  # 2 x 6144 = 12288: traces


def mailbox_spec(tp, **kw):
    return k3.MailboxSpec(k3.MailboxLayout(tp), **kw)


TABLE = functools.partial(spec, dtype=jnp.uint32)


@pytest.mark.parametrize("tp,mailbox,table,pattern", [
    (2, mailbox_spec(4), TABLE((5, 2)), r"axis 'tp' has 2 ranks; the mailbox has tp=4"),
    (2, mailbox_spec(2, virtual=True), TABLE((3, 2)),
     r"is virtual \(every rank's buffer on one device\) and cannot serve mesh axis 'tp'"),
    (2, mailbox_spec(2), None, r"has no memory: pass its peer_table= \(uint32 \[3, 2\]"),
    (2, mailbox_spec(2), TABLE((2, 2)), r"peer_table has shape=\(2, 2\) dtype=uint32; "
                                        r"expected shape=\(3, 2\) dtype=uint32"),
    (2, mailbox_spec(2), spec((3, 2), jnp.int32), r"peer_table has .* dtype=int32"),
    (2, mailbox_spec(2), TABLE((2, 3, 2)), r"peer_table has shape=\(2, 3, 2\) dtype=uint32; "
                                           r"expected shape=\(1, 3, 2\)"),
])
def test_tail_rejects_mailbox(tp, mailbox, table, pattern):
    with pytest.raises(ValueError, match=r"^oproj_attn_res: .*" + pattern):
        kimi_tail_trace(tp, 12288 // tp, mailbox, table)


def test_mailbox_serves_one_tp_group():
    """A ("dp", "tp") mesh: each dp group would share the one TP mailbox's buffers."""
    with pytest.raises(ValueError, match=r"the mesh has other axes \{'dp': 2\} beside 'tp': "
                                         r"each of their 2 groups of 2 ranks would share .* "
                                         r"use MeshMailbox\(mesh, 'tp'\)"):
        kimi_tail_trace(4, 6144, mailbox_spec(2), TABLE((3, 2)), shape=(2, 2),
                        axes=("dp", "tp"))
    with pytest.raises(ValueError, match=r"the mesh's other axes \{'dp': 2\} make 2 groups of "
                                         r"'tp'; the mailbox serves groups=3"):
        kimi_tail_trace(4, 6144, mailbox_spec(2, groups=3), TABLE((3, 2)), shape=(2, 2),
                        axes=("dp", "tp"))
    # One group per dp index, each device its own table block: traces.
    kimi_tail_trace(4, 6144, mailbox_spec(2, groups=2), TABLE((1, 1, 3, 2)), shape=(2, 2),
                    axes=("dp", "tp"))


@pytest.mark.parametrize("axis_name,tp,groups", [(("tp",), 2, 2), (("dp", "tp"), 4, 1)])
def test_mailbox_on_a_tuple_of_axes(axis_name, tp, groups):
    """A tuple axis_name is the TP axis: none of its axes counts among the mesh's other axes
    (each dp group its own mailbox, or one mailbox over both axes)."""
    kimi_tail_trace(4, 12288 // tp, mailbox_spec(tp, groups=groups), TABLE((1, 1, tp + 1, 2)),
                    shape=(2, 2), axes=("dp", "tp"), axis_name=axis_name)


def test_concurrent_command_buffers_refused(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
    with pytest.raises(ValueError, match=r"XLA could then run two mailbox calls at once"):
        kimi_tail_trace(2, 6144, mailbox_spec(2), TABLE((3, 2)))


def test_backend_kernel_needs_a_gpu(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(ValueError, match=r"backend='kernel': needs a CUDA GPU \(JAX's default "
                                         r"backend here is 'cpu'\); to lower the kernels for "
                                         r"CUDA on this host, set CUTE_DSL_ARCH=sm_90a"):
        trace_attn_res({**attn_args(h=7168), "blocks": spec((4, NB, 7168))}, num_blocks=2,
                       backend="kernel")


def test_backend_kernel_needs_kimi_h():
    with pytest.raises(ValueError, match=r"the kernels are built for H=7168; got H=256"):
        trace_attn_res(attn_args(), num_blocks=2, backend="kernel")


@pytest.mark.parametrize("make,pattern", [
    (lambda: k3.AttentionTail(3), r"plan=3 must be a LayerPlan"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), axis_name=["tp"]),
     r"axis_name=\['tp'\] is a static argument and must be hashable"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), mailbox=object()),
     r"mailbox=<object .* must be a Mailbox, a MeshMailbox, a MailboxSpec or None"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), backend="xla"),
     r"backend='xla' must be one of"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), two_shot="yes"),
     r"two_shot='yes' must be True or False or None"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), two_shot=1),
     r"two_shot=1 must be True or False or None"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), variant="fused", two_shot=True),
     r"variant='fused' is one-shot without statistics ahead; got two_shot=True"),
    (lambda: k3.AttentionTail(k3.KimiK3Config(attn_res_block_size=2).layer(3)),
     r"plan \(layer index=3\) is not one of Kimi K3's layer plans: pass KIMI_K3.layer\(i\)"),
    (lambda: k3.AttentionTail(k3.KIMI_K3.layer(0), variant="two_shot"),
     r"variant='two_shot' must be None or one of \('fused', 'split', 'xla'\)"),
])
def test_attention_tail_rejects(make, pattern):
    with pytest.raises(ValueError, match=r"^AttentionTail: " + pattern):
        make()


def test_tail_calls_need_their_weights():
    inp = attn_args()
    tail = k3.AttentionTail(k3.KIMI_K3.layer(1))
    with pytest.raises(ValueError, match=r"pre_attention: weights=\(.* must be an AttnResWeights"):
        tail.pre_attention((inp["res_norm_w"],) * 3, inp["prefix"], inp["blocks"], inp["prefix"])
    with pytest.raises(ValueError, match=r"final: weights=None must be an AttnResWeights"):
        k3.final_attn_res(None, inp["prefix"], inp["blocks"], inp["prefix"], num_layers=3)


@pytest.mark.parametrize("num_layers,pattern", [
    (2.5, r"num_layers=2.5 must be an integer"), (0, r"num_layers=0 must be in \[1, 93\]")])
def test_final_attn_res_num_layers(num_layers, pattern):
    inp = attn_args()
    w = k3.AttnResWeights(inp["res_norm_w"], inp["res_proj_w"], inp["out_norm_w"])
    with pytest.raises(ValueError, match=pattern):
        k3.final_attn_res(w, inp["prefix"], inp["blocks"], inp["prefix"], num_layers=num_layers)


def reduce_trace(f, rows, tp=2):
    return on_mesh(f, tp).trace(rows, TABLE((tp + 1, 2)))


@pytest.mark.parametrize("rows,static,pattern", [
    (spec((4, 7168)), dict(two_shot="no"), r"two_shot='no' must be True or False"),
    (spec((4, 7168)), dict(two_shot=None), r"two_shot=None must be True or False"),
    (spec((65, 7168)), {}, r"rows has batch B=65; must be in \[1, 64\]"),
    (spec((4, 7168), jnp.float32), {}, r"rows has shape=\(4, 7168\) dtype=float32; expected "
                                       r"\[B, H\] bfloat16"),
    (spec((4, 1024)), {}, r"rows has H=1024; the mailbox's rows have hidden=7168"),
    (spec((4, 7168)), dict(axis_name="dp"), r"axis_name='dp' is not bound"),
    (spec((4, 7168)), dict(mailbox=None), r"mailbox=None must be a Mailbox, a MeshMailbox, a MailboxSpec"),
])
def test_all_reduce_rejects(rows, static, pattern):
    kw = dict(dict(axis_name="tp", mailbox=mailbox_spec(2)), **static)
    mailbox = kw.pop("mailbox")
    with pytest.raises(ValueError, match=r"^all_reduce: .*" + pattern):
        reduce_trace(lambda r, t: k3.all_reduce(r, mailbox, peer_table=t, **kw), rows)


@pytest.mark.parametrize("partials,mailbox,pattern", [
    (spec((2, 4, 7168)), mailbox_spec(4, virtual=True),
     r"partials has TP=2 shards; the mailbox has tp=4"),
    (spec((4, 7168)), mailbox_spec(2, virtual=True), r"partials has shape=\(4, 7168\); expected"),
    (spec((2, 4, 7168)), mailbox_spec(2),
     r"has its 2 ranks on different devices; virtual TP runs every rank on one device"),
    (spec((0, 4, 7168)), mailbox_spec(2, virtual=True),
     r"partials has shape=\(0, 4, 7168\); expected \[TP, B, H\] with TP >= 1"),
])
def test_all_reduce_virtual_rejects(partials, mailbox, pattern):
    with pytest.raises(ValueError, match=r"^all_reduce_virtual: .*" + pattern):
        jax.jit(lambda p, t: k3.all_reduce_virtual(p, mailbox, peer_table=t)).trace(
            partials, TABLE((mailbox.tp + 1, 2)))


def test_all_reduce_needs_the_kernels(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(ValueError, match=r"^all_reduce: the all-reduce runs on the kernels: "
                                         r"needs a CUDA GPU"):
        reduce_trace(lambda r, t: k3.all_reduce(r, mailbox_spec(2), axis_name="tp",
                                                peer_table=t), spec((4, 7168)))


@pytest.mark.parametrize("make,pattern", [
    (lambda: k3.MailboxLayout(0), r"tp=0 must be in \[1, 32\]"),
    (lambda: k3.MailboxLayout(2.0), r"tp=2.0 must be an integer"),
    (lambda: k3.MailboxLayout(3), r"tp=3 must be >= 1 and divide hidden=7168"),
    (lambda: k3.MailboxLayout(64), r"tp=64 must be in \[1, 32\]"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), timeout_ms=1e-7),
     r"timeout_ms=1e-07 must be a number in \[0.001, 600000\]"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), timeout_ms=0),
     r"timeout_ms=0 must be a number in \[0.001, 600000\]"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), timeout_ms=-5.0), r"timeout_ms=-5.0 must be"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), timeout_ms=float("inf")), r"timeout_ms=inf"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), timeout_ms=1e9), r"timeout_ms=1000000000.0"),
    (lambda: k3.MailboxSpec(k3.MailboxLayout(2), multicast="yes"), r"multicast='yes' must be a bool"),
    (lambda: k3.MailboxSpec(2), r"layout=2 must be a MailboxLayout"),
    (lambda: k3.Mailbox([0], k3.MailboxLayout(2)), r"ordinals=\(0,\) name 1 devices; the layout "
                                                   r"has tp=2 ranks"),
    (lambda: k3.Mailbox([-1], k3.MailboxLayout(1)), r"ordinals\[0\]=-1 must be >= 0"),
    (lambda: k3.Mailbox.for_devices([]), r"devices=\[\] must name at least one CUDA device"),
    (lambda: k3.Mailbox.for_devices(jax.devices()[:2]),
     r"Mailbox.for_devices needs CUDA GPU devices; got devices of platform \['cpu'\]"),
    (lambda: k3.Mailbox.virtual(jax.devices()[0], 2), r"Mailbox.virtual needs a CUDA GPU device"),
    (lambda: k3.Mailbox.for_processes(jax.devices()[:2], name="m"),
     r"Mailbox.for_processes needs CUDA GPU devices; got devices of platform \['cpu'\]"),
])
def test_mailbox_rejects(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_mailbox_needs_cuda_devices():
    """A host without a CUDA driver (CI): the mailbox says what it needs."""
    with pytest.raises(RuntimeError, match=r"Mailbox needs CUDA GPUs"):
        k3.Mailbox([0], k3.MailboxLayout(1))


@pytest.mark.parametrize("num_layers,virtual_tp,pattern", [
    (3, None, r"num_layers=3, but params has 2 layers"),
    (2.0, None, r"num_layers=2.0 must be an integer"),
    (94, None, r"num_layers=94 must be in \[1, 93\]"),
    (2, 5, r"virtual_tp=5 must divide o_proj_in_features=12288"),
    (2, 0, r"virtual_tp=0 must be >= 1"),
])
def test_decode_step_rejects(num_layers, virtual_tp, pattern):
    from jax.sharding import AbstractMesh

    from jax_kimik3 import decode

    params, h, nb = decode.param_shapes(2), decode.H, k3.KIMI_K3.num_attn_res_blocks
    step = decode.make_step(AbstractMesh((2,), ("tp",)), params, num_layers, "reference", None,
                            virtual_tp=virtual_tp)
    with pytest.raises(ValueError, match=pattern):
        step.trace(params, spec((4, h)), spec((4, nb, h)), None)
    if virtual_tp is not None:
        with pytest.raises(ValueError, match=pattern):
            decode.param_shapes(2, virtual_tp)


def test_decode_step_needs_the_tp_axis():
    from jax.sharding import AbstractMesh

    from jax_kimik3 import decode

    with pytest.raises(ValueError, match=r"mesh has axes \{'model': 2\}; the step needs a 'tp' "
                                         r"axis"):
        decode.make_step(AbstractMesh((2,), ("model",)), decode.param_shapes(2), 2,
                         "reference", None)
