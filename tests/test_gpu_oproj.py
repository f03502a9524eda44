"""GPU: the o_proj producer against the float64 model, and the post-attention tail on kernels
in virtual TP against the model: the split tail (producer publish or XLA dot + publish, then
the AttnRes consumer) and the fused tail (one launch; `-k fused` runs those alone)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimik3 as k3
from jax_kimik3 import tuning
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
# delta layer (3: K = 1), a KDA delta layer over two blocks (13: K = 2, where a tail over few
# rows sums the blocks' pairs before its poll and their pairs with p after it), a KDA delta
# layer (46: K = 4), the last layer, MLA (92: K = 8).
LAYERS = [0, 3, 13, 46, 92]


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


@functools.partial(jax.jit, static_argnames=("spec", "num_blocks", "has_delta", "two_shot",
                                             "variant"))
def _tail(xs, ws, inp, table, ahead=None, into=None, *, spec, num_blocks, has_delta,
          two_shot=False, variant=None):
    from jax_kimik3.kernels import oproj
    return oproj.tail(
        xs, ws, inp.prefix, inp.blocks, inp.res_norm_w, inp.res_proj_w, inp.out_norm_w,
        table=table, ranks=jnp.arange(xs.shape[0], dtype=jnp.int32), spec=spec,
        num_blocks=num_blocks, has_delta=has_delta, eps=1e-5, out_eps=1e-5, ahead=ahead,
        two_shot=two_shot, variant=variant, into=into)


def tail_virtual(xs, ws, inp, mailbox, ahead=None, *, poison=False, **static):
    """Every rank's tail on the one GPU (R = TP ranks in the one tail call); `poison`: into
    NaN-filled outputs, so an unwritten element fails the model check."""
    r, b = xs.shape[:2]
    into = None
    if poison:
        into = tuple(jnp.full((r * b, H), jnp.nan, jnp.bfloat16) for _ in range(2))
    return _tail(xs, ws, inp, jnp.asarray(mailbox.peer_table), ahead, into, spec=mailbox.spec,
                 **static)


def check_tail_virtual(rng, mailbox, b, layer, variant, two_shot=False):
    """Every rank's (out, new prefix) bitwise equal, within bf16 of the float64 model, in two
    calls (they use the mailbox's two buffers in turn), into NaN-poisoned outputs; no timeout."""
    tp = mailbox.tp
    site = KIMI_K3.layer(layer).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x = oproj_inputs(rng, b)[0]
    w = weight()
    for _ in range(2):
        out, prefix = map(np.asarray, tail_virtual(
            split(x, tp), split(w, tp), jax.device_put(inp), mailbox, poison=True,
            num_blocks=site.num_blocks, has_delta=site.has_delta, variant=variant,
            two_shot=two_shot))
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
    """The tail in the measured tables' variant and all-reduce: the producer kernel where it
    wins, else XLA's dot + publish; one-shot or two-shot; then the AttnRes consumer. Every
    slot re-armed afterwards."""
    from jax_kimik3.tuning import tail_variant, use_two_shot
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        check_tail_virtual(rng, mailbox, b, layer, tail_variant(b, K_TOTAL // tp),
                           two_shot=use_two_shot(b, tp))
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("b", [24, 33, 64])
@pytest.mark.parametrize("tp", [2, 8, 16])
def test_producer_tail_past_the_table(rng, tp, b, two_shot):
    """The producer kernel's tail (variant "split") at B the table gives to XLA's dot at some
    TP: the staged producer at three, five and eight B tiles, publishing one-shot and
    two-shot."""
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        check_tail_virtual(rng, mailbox, b, 92, "split", two_shot=two_shot)
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
            has_delta=site.has_delta)
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
    oracle.assert_mixture_close(mixture[0], acc, inp.blocks, k)


@pytest.mark.parametrize("layer", [0, 46])
@pytest.mark.parametrize("b", [1, 9, 64])
@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_two_shot_tail_matches_model(rng, tp, b, layer):
    """The tail through the two-shot reduction (owners sum column chunks, the AttnRes consumer
    polls the gather region): bitwise-equal ranks within bf16 of the model, both buffers,
    receive and gather regions re-armed."""
    site = KIMI_K3.layer(layer).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x = oproj_inputs(rng, b)[0]
    w = weight()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        for _ in range(2):
            out, prefix = map(np.asarray, tail_virtual(
                split(x, tp), split(w, tp), jax.device_put(inp), mailbox, poison=True,
                num_blocks=site.num_blocks, has_delta=site.has_delta, two_shot=True))
            for r in range(1, tp):
                np.testing.assert_array_equal(out[r].view(np.uint16), out[0].view(np.uint16))
                np.testing.assert_array_equal(prefix[r].view(np.uint16),
                                              prefix[0].view(np.uint16))
            oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp,
                                     num_blocks=site.num_blocks, has_delta=site.has_delta)
            mailbox.check()
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("layer", [12, 46])  # without and with the delta
@pytest.mark.parametrize("variant, two_shot, b", [
    ("split", False, 5), ("split", False, 33), ("split", True, 33), ("xla", False, 5),
    ("xla", True, 64), ("fused", False, 5)])
def test_tail_sums_in_fp32_in_rank_order(rng, variant, two_shot, b, layer):
    """At TP 8, on inputs whose o_proj rows are exact (`oracle.exact_oproj_inputs`), every
    rank's new prefix is bit for bit the rows summed in fp32 in rank order and rounded once:
    the bound of `assert_tail_close` cannot tell that sum from one rounded at each add."""
    tp, site = 8, KIMI_K3.layer(layer).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x, w = oracle.exact_oproj_inputs(rng, b, K_TOTAL, H)
    want = oracle.exact_tail_prefix(x, w, inp.prefix, tp=tp, has_delta=site.has_delta)
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        prefix = np.asarray(tail_virtual(
            split(x, tp), split(w, tp), jax.device_put(inp), mailbox, poison=True,
            num_blocks=site.num_blocks, has_delta=site.has_delta, variant=variant,
            two_shot=two_shot)[1])
        mailbox.check()
    for r in range(tp):
        np.testing.assert_array_equal(prefix[r].view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("variant", ["split", "xla", "fused"])
def test_public_variant_matches_model(rng, variant):
    """oproj_attn_res_virtual(variant=...) at TP 2, B = 12 (the table: split) and B = 56
    (xla): bitwise-identical ranks within bf16 of the float64 model, every slot re-armed."""
    tp, site = 2, KIMI_K3.layer(46).post_attention
    w = weight()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        for b in (12, 56):
            inp = attn_res_inputs(rng, b, NB)
            x = oproj_inputs(rng, b)[0]
            out, prefix, _ = map(np.asarray, k3.oproj_attn_res_virtual(
                jnp.asarray(split(x, tp)), jnp.asarray(split(w, tp)), inp.prefix, inp.blocks,
                inp.res_norm_w, inp.res_proj_w, inp.out_norm_w, num_blocks=site.num_blocks,
                has_delta=site.has_delta, mailbox=mailbox, variant=variant, backend="kernel"))
            np.testing.assert_array_equal(out[1].view(np.uint16), out[0].view(np.uint16))
            oracle.assert_tail_close(out[0], prefix[0], x, w, inp, tp=tp,
                                     num_blocks=site.num_blocks, has_delta=site.has_delta)
            mailbox.check()
        assert mailbox.unarmed() == 0


@pytest.mark.parametrize("variant", ["split", "xla", "fused"])
def test_tail_without_its_peer_is_nan_rows(rng, variant):
    """Rank 0's tail alone on a TP2 mailbox (rank 1 never publishes): after the timeout its
    out and new prefix are NaN over every row (not rank 0's own rows mixed), the timeout is
    recorded, and the next call of both ranks is NaN too until the host re-arms."""
    b, tp = 4, 2
    site = KIMI_K3.layer(46).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)[0], weight()
    xs, ws = split(x, tp), split(w, tp)
    with Mailbox.virtual(jax.devices()[0], tp, timeout_ms=200.0) as mailbox:
        out, prefix = map(np.asarray, tail_virtual(
            xs[:1], ws[:1], jax.device_put(inp), mailbox, num_blocks=site.num_blocks,
            has_delta=site.has_delta, variant=variant))
        assert np.isnan(out.astype(np.float32)).all() and np.isnan(prefix.astype(np.float32)).all()
        with pytest.raises(TimeoutError, match=r"rank 0 \(AttnRes tail consumer\) gave up in "
                                               r"call 1 since arm\(\) waiting for rows of "
                                               r"rank\(s\) \[1\]"):
            mailbox.check()
        both = tail_virtual(xs, ws, jax.device_put(inp), mailbox, num_blocks=site.num_blocks,
                            has_delta=site.has_delta, variant=variant)[0]
        assert np.isnan(np.asarray(both).astype(np.float32)).all()
        mailbox.arm()
        check_tail_virtual(rng, mailbox, b, 46, variant)
        assert mailbox.unarmed() == 0


def weights(inp):
    return k3.AttnResWeights(inp.res_norm_w, inp.res_proj_w, inp.out_norm_w)


@pytest.mark.parametrize("b, variant", [(8, None), (64, "xla")])
def test_decode_steps_back_to_back(rng, b, variant):
    """Two steps of Kimi K3's 93 post-attention tails in one jit on one TP2 mailbox (an odd
    layer count: layer 92 and the next step's layer 0 follow one another), dispatched without
    a host sync: every layer's (out, new prefix) within bf16 of the float64 model on its input
    prefix, every slot armed and 186 calls counted per rank. B = 8: the table's tail (the
    producer's); B = 64: XLA's dot, asked for (no table entry at TP 2 runs it)."""
    tp, distinct = 2, 3
    chosen = variant or tuning.tail_variant(b, KIMI_K3.o_proj_local_features(tp))
    assert chosen == {8: "split", 64: "xla"}[b]
    inp = attn_res_inputs(rng, b, NB)
    x_bank = [oproj_inputs(rng, b)[0] for _ in range(distinct)]
    w = weight()
    plans = KIMI_K3.layers()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        @jax.jit
        def steps(prefix, blocks, x_bank, ws):
            outs, prefixes = [], []
            for _ in range(2):
                for plan in plans:
                    tail = k3.AttentionTail(plan, mailbox=mailbox, variant=variant)
                    out, prefix, _ = tail.post_attention_virtual(
                        weights(inp), x_bank[plan.index % distinct], ws, prefix, blocks)
                    outs.append(out)
                    prefixes.append(prefix)
            return jnp.stack(outs), jnp.stack(prefixes)

        outs, prefixes = map(np.asarray, steps(
            jnp.asarray(inp.prefix), jnp.asarray(inp.blocks),
            [jnp.asarray(split(x, tp)) for x in x_bank], jnp.asarray(split(w, tp))))
        mailbox.check()
        assert mailbox.unarmed() == 0 and mailbox.calls() == [2 * len(plans)] * tp
    products = [oracle.tail_products(x, w, tp) for x in x_bank]
    for i in range(2 * len(plans)):
        plan = plans[i % len(plans)]
        site = plan.post_attention
        before = inp.prefix if i == 0 else prefixes[i - 1]
        oracle.assert_tail_close(outs[i], prefixes[i], x_bank[plan.index % distinct], w,
                                 inp._replace(prefix=before), tp=tp, num_blocks=site.num_blocks,
                                 has_delta=site.has_delta,
                                 products=products[plan.index % distinct])


@pytest.mark.parametrize("b", [8, 20])
def test_same_layer_repeated(rng, b):
    """One layer's tail five times in a row on one mailbox (no layer parity to alternate):
    each call within bf16 of the model, every slot armed. The producer's tail at one and at
    three B tiles (B = 8, 20)."""
    tp = 4
    site = KIMI_K3.layer(46).post_attention
    inp = attn_res_inputs(rng, b, NB)
    x, w = oproj_inputs(rng, b)[0], weight()
    with Mailbox.virtual(jax.devices()[0], tp) as mailbox:
        tail = k3.AttentionTail(KIMI_K3.layer(46), mailbox=mailbox)

        @jax.jit
        def repeated(prefix, xs, ws):
            results = []
            for _ in range(5):
                out, prefix, _ = tail.post_attention_virtual(weights(inp), xs, ws, prefix,
                                                             inp.blocks)
                results.append((out, prefix))
            return results

        results = repeated(jnp.asarray(inp.prefix), jnp.asarray(split(x, tp)),
                           jnp.asarray(split(w, tp)))
        mailbox.check()
        assert mailbox.unarmed() == 0 and mailbox.calls() == [5] * tp
    products = oracle.tail_products(x, w, tp)
    before = inp.prefix
    for out, prefix in results:
        oracle.assert_tail_close(np.asarray(out), np.asarray(prefix), x, w,
                                 inp._replace(prefix=before), tp=tp, num_blocks=site.num_blocks,
                                 has_delta=site.has_delta, products=products)
        before = np.asarray(prefix)
