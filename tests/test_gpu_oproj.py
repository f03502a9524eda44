"""GPU: the post-attention tail on kernels (publish + AttnRes ring consumer), virtual TP."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimik3 as k3
from jax_kimik3 import reference
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from tests import oracle

pytestmark = pytest.mark.gpu
NB, K_TOTAL = 8, 12288


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@functools.partial(jax.jit, static_argnames=("mailbox", "num_blocks", "has_delta", "parity"))
def tail_both_ways(partials, inp, mailbox, *, num_blocks, has_delta, parity):
    """Each rank's kernel results, and the reference on the same rows summed in rank order."""
    from jax_kimik3.kernels import oproj
    out, prefix = oproj.tail_virtual(
        partials, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
        table=jnp.asarray(mailbox.peer_table), layout=mailbox.layout, parity=parity,
        num_blocks=num_blocks, has_delta=has_delta, eps=1e-5, out_eps=1e-5, max_spins=1 << 16)
    acc = partials[0].astype(jnp.float32)
    for r in range(1, partials.shape[0]):
        acc = acc + partials[r].astype(jnp.float32)
    attn_out = reference.round_bf16(acc).astype(jnp.bfloat16)
    args = (inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)
    if has_delta:
        want = reference.attn_res(inp.prefix, *args, num_blocks=num_blocks, delta=attn_out)
    else:
        want = reference.attn_res(attn_out, *args, num_blocks=num_blocks)
    return out, prefix, want[0], want[1]


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
@pytest.mark.parametrize("b", [1, 8, 33, 64])
@pytest.mark.parametrize("tp", [2, 8, 16])
def test_tail_matches_reference(rng, tp, b, has_delta):
    inp = jax.device_put(attn_res_inputs(rng, b, NB))
    x, w = oproj_inputs(rng, b, K_TOTAL)
    # The ranks' o_proj rows, computed once: cuBLAS need not repeat a dot bit for bit.
    partials = jax.jit(jax.vmap(reference.oproj_partial))(
        jnp.stack(np.split(x, tp, axis=1)), jnp.stack(np.split(w, tp, axis=1)))
    with k3.Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        for parity in (0, 1):
            out, prefix, want_out, want_prefix = map(np.asarray, tail_both_ways(
                partials, inp, mailbox, num_blocks=3, has_delta=has_delta, parity=parity))
            for r in range(tp):  # rank-order sums: every rank's prefix is the reference's, bit for bit
                np.testing.assert_array_equal(prefix[r].view(np.uint16), want_prefix.view(np.uint16),
                                              err_msg=f"rank {r} parity {parity}")
                np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
            oracle.assert_bf16_close(out[0], want_out.astype(np.float64), "out")
            mailbox.check()
