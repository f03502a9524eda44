"""GPU, two or more devices: the mailbox all-reduce and the post-attention tail under shard_map
on a real TP mesh (one JAX device per GPU, peer-mapped mailboxes, no multicast), every rank
checked against the references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from tests import oracle

pytestmark = pytest.mark.gpu
H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


@pytest.fixture(scope="module")
def mesh():
    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        pytest.skip("needs two or more GPUs")
    return Mesh(np.array(jax.devices()), ("tp",))


@pytest.fixture(scope="module")
def mailbox(mesh):
    with k3.Mailbox.for_devices(mesh.devices.flat) as box:
        yield box


@functools.partial(jax.jit, static_argnames=("mesh", "mailbox", "two_shot"))
def reduce_on_mesh(partials, *, mesh, mailbox, two_shot):
    """partials [T, B, H] (rank r's rows at r) → every rank's all-reduced rows [T, B, H]."""
    return jax.shard_map(
        lambda p: k3.all_reduce(p[0], mailbox, axis_name="tp", two_shot=two_shot)[None],
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))(partials)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("b", [1, 8, 33, 64])
def test_all_reduce_on_mesh(rng, mesh, mailbox, b, two_shot):
    """Every rank gets the fp32 rank-order sum, bit for bit; every slot is re-armed."""
    for call in range(2):  # the mailbox's two buffers in turn, fresh rows each
        partials = oracle.to_bf16(rng.standard_normal((mailbox.tp, b, H)))
        want = oracle.rank_order_sum(list(partials))
        got = np.asarray(reduce_on_mesh(jnp.asarray(partials), mesh=mesh, mailbox=mailbox,
                                        two_shot=two_shot))
        for r in range(mailbox.tp):
            np.testing.assert_array_equal(got[r].view(np.uint16), want.view(np.uint16),
                                          err_msg=f"rank {r}, call {call}")
    mailbox.check()
    assert mailbox.unarmed() == 0


@functools.partial(jax.jit, static_argnames=("mesh", "mailbox", "num_blocks", "has_delta",
                                             "backend", "two_shot"))
def tail_on_mesh(x, w, inp, *, mesh, mailbox, num_blocks, has_delta, backend, two_shot=None):
    """Every rank's (out, new_prefix) of `oproj_attn_res`: [T, B, H] each."""
    def tail(x, w, prefix, blocks, g, proj, out_w):
        out, new_prefix, _ = k3.oproj_attn_res(
            x, w, prefix, blocks, g, proj, out_w, axis_name="tp", num_blocks=num_blocks,
            has_delta=has_delta, mailbox=mailbox, two_shot=two_shot, backend=backend)
        return out[None], new_prefix[None]
    return jax.shard_map(tail, mesh=mesh, in_specs=(P(None, "tp"),) * 2 + (P(),) * 5,
                         out_specs=P("tp"))(x, w, inp.prefix, inp.blocks, inp.res_norm_w,
                                            inp.res_proj_w, inp.out_norm_w)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
@pytest.mark.parametrize("b", [1, 8, 33, 64])
def test_tail_on_mesh(rng, mesh, mailbox, b, has_delta, two_shot):
    """Kernels on every rank: bitwise-identical ranks, within bf16 of the float64 model and of
    the reference path (dot + psum + reference AttnRes) on the same mesh."""
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    args = dict(mesh=mesh, num_blocks=5, has_delta=has_delta)
    want_out, _ = map(np.asarray, tail_on_mesh(x, w, inp, mailbox=None, backend="reference",
                                               **args))
    for _ in range(2):
        out, prefix = map(np.asarray, tail_on_mesh(x, w, inp, mailbox=mailbox,
                                                   backend="kernel", two_shot=two_shot,
                                                   **args))
        for r in range(mailbox.tp):
            np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
            np.testing.assert_array_equal(prefix[r].view(np.uint16), prefix[0].view(np.uint16))
            # The two paths' attn_out may round one bf16 ulp apart (other fp32 dot orders), and
            # each out rounds once: rows agree to a bf16 ulp in norm (the model check below
            # is the element-wise one, on the kernels' own attn_out).
            diff = np.linalg.norm(oracle.f64(out[r]) - oracle.f64(want_out[r]), axis=-1)
            assert (diff <= oracle.BF16_RTOL
                    * np.linalg.norm(oracle.f64(want_out[r]), axis=-1)).all(), f"rank {r}"
        oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=mailbox.tp, num_blocks=5,
                                 has_delta=has_delta)
    mailbox.check()
    assert mailbox.unarmed() == 0


@functools.partial(jax.jit, static_argnames=("mesh", "mailbox", "batch", "two_shot"))
def stress_step(key, *, mesh, mailbox, batch, two_shot):
    """One step on the mesh: fresh random rows per rank, the mailbox all-reduce, and the count
    of elements (over all ranks) that differ from the fp32 rank-order sum of the gathered rows."""
    def step(key):
        rank = jax.lax.axis_index("tp")
        rows = reference.round_bf16(jax.random.normal(jax.random.fold_in(key, rank),
                                                      (batch, H))).astype(jnp.bfloat16)
        got = k3.all_reduce(rows, mailbox, axis_name="tp", two_shot=two_shot)
        every = jax.lax.all_gather(rows, "tp")
        acc = every[0].astype(jnp.float32)
        for r in range(1, mailbox.tp):
            acc = acc + every[r].astype(jnp.float32)
        want = reference.round_bf16(acc).astype(jnp.bfloat16)
        differ = jnp.sum(jax.lax.bitcast_convert_type(got, jnp.uint16)
                         != jax.lax.bitcast_convert_type(want, jnp.uint16))
        return jax.lax.psum(differ.astype(jnp.int32), "tp")
    return jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())(key)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_ten_thousand_steps_on_mesh(mesh, mailbox, two_shot):
    """10,000 steps dispatched without host syncs, random batch sizes: no mismatch on any
    rank, no timeout, and every slot re-armed (checked every 2,500 steps)."""
    rng = np.random.default_rng(11)
    batches = rng.choice([1, 2, 5, 8, 17, 33, 64], 10_000)
    keys = jax.random.split(jax.random.key(1), 10_000)
    total = jnp.zeros((), jnp.int32)
    for step, batch in enumerate(batches):
        total = total + stress_step(keys[step], mesh=mesh, mailbox=mailbox, batch=int(batch),
                                    two_shot=two_shot)
        if step % 2500 == 2499:
            assert int(total) == 0, f"mismatches by step {step}"
            mailbox.check()
            assert mailbox.unarmed() == 0, f"unarmed words after step {step}"


@functools.partial(jax.jit, static_argnames=("mesh", "mailbox", "num_blocks", "has_delta",
                                             "variant"))
def tail_variant_on_mesh(x, w, inp, *, mesh, mailbox, num_blocks, has_delta, variant):
    """Every rank's (out, new_prefix) of the kernel tail forced to `variant`: [T, B, H] each."""
    from jax_kimik3.kernels import oproj

    def tail(x, w, prefix, blocks, g, proj, out_w):
        rank = jax.lax.axis_index("tp").astype(jnp.int32).reshape(1)
        out, new_prefix = oproj.tail(
            x[None], w[None], prefix, blocks, g, proj, out_w,
            table=jnp.asarray(mailbox.peer_table), ranks=rank, spec=mailbox.spec,
            num_blocks=num_blocks, has_delta=has_delta, eps=1e-5, out_eps=1e-5,
            variant=variant)
        return out, new_prefix
    return jax.shard_map(tail, mesh=mesh, in_specs=(P(None, "tp"),) * 2 + (P(),) * 5,
                         out_specs=P("tp"))(x, w, inp.prefix, inp.blocks, inp.res_norm_w,
                                            inp.res_proj_w, inp.out_norm_w)


@pytest.mark.parametrize("variant", ["fused", "split"])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
@pytest.mark.parametrize("b", [1, 2, 5, 8, 9, 16])
def test_fused_and_split_tail_on_mesh(rng, mesh, mailbox, b, has_delta, variant):
    """The fused tail (one launch per rank) and the split one on a real mesh: bitwise-identical
    ranks within bf16 of the float64 model, two calls, every slot re-armed."""
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    for _ in range(2):
        out, prefix = map(np.asarray, tail_variant_on_mesh(
            x, w, inp, mesh=mesh, mailbox=mailbox, num_blocks=5, has_delta=has_delta,
            variant=variant))
        for r in range(1, mailbox.tp):
            np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
            np.testing.assert_array_equal(prefix[r].view(np.uint16), prefix[0].view(np.uint16))
        oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=mailbox.tp, num_blocks=5,
                                 has_delta=has_delta)
        mailbox.check()
    assert mailbox.unarmed() == 0


def slow(x, rank, step):
    """x, later on one rank: a chain of matmuls on rank `step % T` only (lax.cond runs one
    branch per device), so that rank's tail starts late and its peers wait in their consumers."""
    def work(a):
        m = jnp.ones((2048, 2048), jnp.bfloat16) * a[0, 0]
        for _ in range(8):
            m = jnp.tanh((m @ m) * jnp.bfloat16(1e-3))  # bounded: 0 * m is 0, never NaN
        return a + 0 * m[0, 0]
    return jax.lax.cond(rank == step % jax.lax.axis_size("tp"), work, lambda a: a, x)


def test_thousand_steps_of_93_tails_with_a_slow_rank(rng, mesh, mailbox):
    """1,000 steps of Kimi K3's 93 post-attention tails dispatched without host syncs, one rank
    (a different one each step) slowed before its tail, each tail's x rolled by its call's
    number so that no two calls in a row publish the same rows (a stale or early row shows):
    every step within bf16 of the reference path on the same inputs, step 0 again bit for bit
    (the kernels are deterministic), no timeout, every slot armed."""
    b = 8
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)
    plans = k3.KIMI_K3.layers()

    def layers(step, x, w, prefix, blocks, g, proj, out_w, backend):
        rank = jax.lax.axis_index("tp")
        for plan in plans:
            tail = k3.AttentionTail(plan, mailbox=mailbox if backend == "kernel" else None,
                                    backend=backend)
            xs = jnp.roll(x, step * len(plans) + plan.index, axis=1)
            if backend == "kernel":
                xs = slow(xs, rank, step + plan.index)
            _, prefix, _ = tail.post_attention(k3.AttnResWeights(g, proj, out_w), xs, w,
                                               prefix, blocks)
        return prefix

    steps = {backend: jax.jit(jax.shard_map(
        functools.partial(layers, backend=backend), mesh=mesh,
        in_specs=(P(),) + (P(None, "tp"),) * 2 + (P(),) * 5, out_specs=P()))
        for backend in ("kernel", "reference")}
    args = (x, w, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)
    outs = [steps["kernel"](jnp.int32(s), *args) for s in range(1000)]
    for s, out in enumerate(outs):
        want = np.asarray(steps["reference"](jnp.int32(s), *args)).astype(np.float64)
        oracle.assert_bf16_close(out, want, f"step {s}: 93 layers vs the reference")
    again = np.asarray(steps["kernel"](jnp.int32(0), *args))
    np.testing.assert_array_equal(again.view(np.uint16), np.asarray(outs[0]).view(np.uint16))
    mailbox.check()
    assert mailbox.unarmed() == 0
