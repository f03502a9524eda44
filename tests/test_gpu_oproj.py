"""GPU: the o_proj producer against the float64 model, and the post-attention tail on kernels
in virtual TP against the model: the split tail (producer publish or XLA dot + publish, then
the AttnRes ring consumer) and the fused tail (one launch; `-k fused` runs those alone)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kimik3.config import KIMI_K3
from jax_kimik3.inputs import attn_res_inputs, oproj_inputs
from jax_kimik3.mailbox import Mailbox
from tests import oracle

pytestmark = pytest.mark.gpu
H, K_TOTAL, NB = KIMI_K3.hidden_size, KIMI_K3.o_proj_in_features, KIMI_K3.num_attn_res_blocks
BATCHES = [1, 2, 5, 8, 9, 16, 33, 64]
FUSED_BATCHES = [1, 2, 5, 8, 9, 16]  # the fused kernel supports every B <= 64; it is for small B
TPS = [1, 2, 4, 8, 16]
# Post-attention call sites that differ: a KDA write layer (0: starts a block, K = 1), an MLA
# delta layer (3: K = 1), a KDA delta layer (46: K = 4), the last layer, MLA (92: K = 8).
LAYERS = [0, 3, 46, 92]


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@functools.cache
def weight():
    """One o_proj weight [H, 12288] per test process (88M random numbers take seconds)."""
    return oproj_inputs(np.random.default_rng(1), 1)[1]


def split(a, tp):
    """[..., K] → [tp, ..., K / tp]: each rank's shard along K."""
    return np.stack(np.split(a, tp, axis=-1))


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("tp", TPS)
def test_producer_rows(rng, tp, b):
    """One rank's bf16(x @ w.T) at K = 12288 / TP into a NaN-poisoned output."""
    from jax_kimik3.kernels import producer_ops as producer
    x = oproj_inputs(rng, b)[0][:, : K_TOTAL // tp]
    w = weight()[:, : K_TOTAL // tp]
    poison = jnp.full((b, H), jnp.nan, jnp.bfloat16)
    got = np.asarray(jax.jit(producer.project)(x, w, poison))
    want = oracle.f64(x) @ oracle.f64(w).T
    bound = oracle.BF16_RTOL * np.abs(want) + oracle.DOT_RTOL * (np.abs(oracle.f64(x))
                                                                 @ np.abs(oracle.f64(w)).T)
    err = np.abs(oracle.f64(got) - want)
    assert (err <= bound).all(), f"{(~(err <= bound)).sum()} elements off (NaN: unwritten)"


@functools.partial(jax.jit, static_argnames=("mailbox", "num_blocks", "has_delta", "parity",
                                             "two_shot", "variant"))
def tail_virtual(xs, ws, inp, mailbox, ahead=None, *, num_blocks, has_delta, parity,
                 two_shot=False, variant=None, into=None):
    from jax_kimik3.kernels import oproj
    return oproj.tail_virtual(
        xs, ws, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
        table=jnp.asarray(mailbox.peer_table), layout=mailbox.layout, parity=parity,
        num_blocks=num_blocks, has_delta=has_delta, eps=1e-5, out_eps=1e-5, max_spins=1 << 20,
        ahead=ahead, two_shot=two_shot, variant=variant, into=into)


def check_tail_virtual(rng, mailbox, b, layer, variant):
    """Every rank's (out, new prefix) bitwise equal, within bf16 of the float64 model, at the
    layer's parity and then the other one; no timeout. The fused variant writes into
    NaN-poisoned outputs (an unwritten element fails the model check)."""
    tp = mailbox.tp
    site = KIMI_K3.layer(layer).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x = oproj_inputs(rng, b)[0]
    w = weight()
    for parity in (KIMI_K3.layer(layer).parity, 1 - KIMI_K3.layer(layer).parity):
        into = None
        if variant == "fused":
            into = tuple(jnp.full((tp, b, H), jnp.nan, jnp.bfloat16) for _ in range(2))
        out, prefix = map(np.asarray, tail_virtual(
            split(x, tp), split(w, tp), jax.device_put(inp), mailbox,
            num_blocks=site.num_blocks, has_delta=site.has_delta, parity=parity,
            variant=variant, into=into))
        for r in range(1, tp):
            np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
            np.testing.assert_array_equal(prefix[r].view(np.uint16), prefix[0].view(np.uint16))
        oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp,
                                 num_blocks=site.num_blocks, has_delta=site.has_delta)
        mailbox.check()


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("tp", TPS)
def test_tail_matches_model(rng, tp, b, layer):
    """The split tail as the measured table had it before the fused kernel: the producer kernel
    where it wins, else XLA's dot + publish; then the AttnRes ring consumer. Every slot
    re-armed afterwards."""
    from jax_kimik3.tuning import use_producer
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        check_tail_virtual(rng, mailbox, b, layer,
                           "split" if use_producer(b, K_TOTAL // tp) else "xla")
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("b", FUSED_BATCHES)
@pytest.mark.parametrize("tp", TPS)
def test_fused_tail_matches_model(rng, tp, b, layer):
    """The fused tail: every rank's producer and consumer in one launch; every slot re-armed
    afterwards."""
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        check_tail_virtual(rng, mailbox, b, layer, "fused")
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("tp", [2, 16])
def test_fused_and_split_tails_share_a_mailbox(rng, tp):
    """Layer after layer on one mailbox, the variant changing (as the table does when B
    changes): each layer matches the model, and every slot is re-armed at the end."""
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        for (layer, variant), b in zip(zip(LAYERS, ("fused", "split", "fused", "xla")),
                                       (8, 2, 1, 5)):
            check_tail_virtual(rng, mailbox, b, layer, variant)
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("tp", [2, 8])
def test_tail_statistics_ahead(rng, tp, b, layer):
    """The tail that also returns the next site's statistics: the same (out, prefix) as the
    model, and on every rank bitwise-equal statistics of the saved blocks under the next
    site's weights, against float64."""
    site = KIMI_K3.layer(layer).post_attention
    inp, later = attn_res_inputs(rng, b, NB), attn_res_inputs(rng, b, NB)
    x = oproj_inputs(rng, b)[0]
    w = weight()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        out, prefix, stats = tail_virtual(
            split(x, tp), split(w, tp), jax.device_put(inp), mailbox,
            (later.res_norm_w, later.res_proj_w), num_blocks=site.num_blocks,
            has_delta=site.has_delta, parity=KIMI_K3.layer(layer).parity)
        out, prefix, mixture, scal = map(np.asarray, (out, prefix, *stats))
        mailbox.check()
        assert mailbox.unarmed() == 0
    oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp, num_blocks=site.num_blocks,
                             has_delta=site.has_delta)
    for r in range(1, tp):
        np.testing.assert_array_equal(mixture[r], mixture[0])
        np.testing.assert_array_equal(scal[r], scal[0])
    k = site.num_blocks
    acc, m, s = oracle.statistics(inp.blocks, later.res_norm_w, later.res_proj_w, num_blocks=k)
    np.testing.assert_allclose(scal[0], np.stack([m, s], -1), rtol=oracle.F32_RTOL,
                               atol=oracle.F32_RTOL)
    scale = np.abs(oracle.f64(inp.blocks)[:, :k]).sum(1)
    assert (np.abs(oracle.f64(mixture[0]) - acc) <= oracle.F32_RTOL * scale).all()


@pytest.mark.parametrize("layer", [0, 46])
@pytest.mark.parametrize("b", [1, 9, 64])
@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_two_shot_tail_matches_model(rng, tp, b, layer):
    """The tail through the two-shot reduction (owners sum column chunks, the AttnRes consumer
    polls the gather region): bitwise-equal ranks within bf16 of the model, both parities,
    receive and gather regions re-armed."""
    site = KIMI_K3.layer(layer).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x = oproj_inputs(rng, b)[0]
    w = weight()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        for parity in (0, 1):
            out, prefix = map(np.asarray, tail_virtual(
                split(x, tp), split(w, tp), jax.device_put(inp), mailbox,
                num_blocks=site.num_blocks, has_delta=site.has_delta, parity=parity,
                two_shot=True))
            for r in range(1, tp):
                np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
            oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp,
                                     num_blocks=site.num_blocks, has_delta=site.has_delta)
            mailbox.check()
        assert mailbox.unarmed() == 0
