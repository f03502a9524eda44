"""GPU: the Lamport all-reduce in virtual TP (all ranks on one GPU) against a float64 sum."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kimik3 as k3
from tests import oracle

pytestmark = pytest.mark.gpu
H = 7168
SPINS = 1 << 16  # polls before a consumer gives up: tens of ms, enough for launched peers


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.fixture(scope="module")
def mailboxes():
    boxes = {}
    yield lambda tp: boxes.setdefault(tp, k3.Mailbox.virtual(jax.devices()[0], tp))
    for box in boxes.values():
        box.close()


def run(partials, mailbox, parity, two_shot):
    return np.asarray(k3.all_reduce_virtual(jnp.asarray(partials), mailbox, parity=parity,
                                            two_shot=two_shot, max_spins=SPINS))


def expected(partials):
    """bf16 of the float64 sum over ranks, and the bound of an fp32 sum in rank order."""
    x = partials.astype(np.float64)
    return x.sum(0), np.abs(x).sum(0)


def assert_all_reduced(got, partials, mailbox):
    tp = partials.shape[0]
    for r in range(1, tp):  # every rank's rows are bitwise identical
        np.testing.assert_array_equal(got[r].view(np.uint16), got[0].view(np.uint16))
    total, magnitude = expected(partials)
    got = got[0].astype(np.float64)
    both_nan = np.isnan(got) & np.isnan(total)
    # fp32 additions in rank order (T·2**-24 of Σ|x|) and one bf16 rounding (half an ulp;
    # one ulp if the fp32 sum lands on the other side of a rounding boundary).
    bound = oracle.BF16_RTOL * np.abs(total) + tp * 2.0**-24 * magnitude
    same_inf = np.isinf(total) & (got == total)
    ok = both_nan | same_inf | (np.abs(got - total) <= bound)
    assert ok.all(), f"{(~ok).sum()} elements off, e.g. got {got[~ok][:4]} want {total[~ok][:4]}"
    assert not mailbox.timed_out()
    assert mailbox.unarmed() == 0, "slots left unarmed"


def bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("b", [1, 8, 33, 64])
@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_virtual_all_reduce(rng, mailboxes, tp, b, two_shot):
    partials = bf16(rng.standard_normal((tp, b, H), np.float32))
    mailbox = mailboxes(tp)
    for parity in (0, 1):
        assert_all_reduced(run(partials, mailbox, parity, two_shot), partials, mailbox)


def adversarial(rng, tp, b):
    """Rows of -0.0, subnormals, ±inf, values near the bf16 maximum, and ordinary values."""
    finfo = ml_dtypes.finfo(ml_dtypes.bfloat16)
    kinds = np.array([-0.0, float(finfo.smallest_subnormal), -float(finfo.smallest_subnormal),
                      3 * float(finfo.smallest_subnormal), np.inf, -np.inf, float(finfo.max),
                      -float(finfo.max), 0.5 * float(finfo.max), 1.0], np.float32)
    partials = kinds[rng.integers(0, len(kinds), (tp, b, H))]
    partials[:, 0] = -0.0  # a whole row of -0: the sum is a zero, never a hang
    return bf16(partials)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("tp", [2, 8])
def test_adversarial_rows(rng, mailboxes, tp, two_shot):
    partials = adversarial(rng, tp, 16)
    mailbox = mailboxes(tp)
    with np.errstate(over="ignore", invalid="ignore"):
        want = oracle.rank_order_sum(partials)
    got = run(partials, mailbox, 1, two_shot)
    for r in range(tp):  # bit for bit, nan for nan; a sum of zeros may be +0 where fp32 gives -0
        same = (got[r].view(np.uint16) == want.view(np.uint16)) | (
            np.isnan(got[r].astype(np.float32)) & np.isnan(want.astype(np.float32))) | (
            (got[r].astype(np.float32) == 0) & (want.astype(np.float32) == 0))
        assert same.all(), f"rank {r}: {(~same).sum()} elements differ"
    assert (got[:, 0].astype(np.float32) == 0).all()  # the row of -0: zeros, and no hang
    assert not mailbox.timed_out() and mailbox.unarmed() == 0


@functools.partial(jax.jit, static_argnames=("mailbox", "parity", "batch", "two_shot"))
def stress_step(key, mailbox, *, parity, batch, two_shot):
    """One step: fresh random partials, the all-reduce, mismatches against fp32 sums in rank
    order (bit-exact), and the unarmed words left after it."""
    from jax_kimik3.kernels import lamport_ops as lamport
    tp = mailbox.tp
    # reduce_precision: XLA keeps this rounding (it may skip a bf16 convert pair in a fusion).
    partials = jax.lax.reduce_precision(jax.random.normal(key, (tp, batch, H), jnp.float32),
                                        exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)
    got = k3.all_reduce_virtual(partials, mailbox, parity=parity, two_shot=two_shot,
                                max_spins=SPINS)
    acc = partials[0].astype(jnp.float32)
    for r in range(1, tp):
        acc = acc + partials[r].astype(jnp.float32)
    want = acc.astype(jnp.bfloat16)
    mismatches = jnp.sum(jax.lax.bitcast_convert_type(got, jnp.uint16)
                         != jax.lax.bitcast_convert_type(want, jnp.uint16)[None])
    left = lamport.unarmed_words(jnp.asarray(mailbox.peer_table), layout=mailbox.layout, after=got)
    return jnp.stack([mismatches.astype(jnp.int32), left[0]])


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_ten_thousand_steps(mailboxes, two_shot):
    """10,000 steps, parity alternating, random batch sizes: no mismatch, every slot re-armed."""
    mailbox = mailboxes(4)
    rng = np.random.default_rng(7)
    batches = rng.choice([1, 2, 5, 8, 17, 33, 64], 10_000)
    keys = jax.random.split(jax.random.key(0), 10_000)
    total = jnp.zeros((2,), jnp.int32)
    for step, batch in enumerate(batches):
        total = total + stress_step(keys[step], mailbox, parity=step % 2, batch=int(batch),
                                    two_shot=two_shot)
    mismatches, unarmed_left = map(int, total)
    assert (mismatches, unarmed_left) == (0, 0)
    assert not mailbox.timed_out()


def test_peer_that_never_publishes_times_out(mailboxes):
    """Rank 0 publishes and waits for rank 1, which never publishes: a reported timeout."""
    from jax_kimik3.kernels import lamport_ops as lamport
    mailbox = mailboxes(2)
    rows = jnp.ones((4, H), jnp.bfloat16)
    out = jax.jit(lambda x, t: lamport.all_reduce(
        x, t, jnp.zeros((1,), jnp.int32), layout=mailbox.layout, parity=0, max_spins=SPINS))(
        rows, jnp.asarray(mailbox.peer_table))
    out.block_until_ready()
    assert mailbox.timed_out() == [0]
    with pytest.raises(TimeoutError, match=r"ranks \[0\] timed out"):
        mailbox.check()
    mailbox.arm()
    assert mailbox.timed_out() == [] and mailbox.unarmed() == 0
