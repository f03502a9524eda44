"""GPU: the Lamport all-reduce in virtual TP (all ranks on one GPU) against a float64 sum, and
what happens when a peer never comes or comes late (docs/protocol.md, Timeouts)."""

import functools
import os
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kimik3 as k3
from tests import oracle

pytestmark = pytest.mark.gpu
H = k3.KIMI_K3.hidden_size
TIMEOUT_MS = 200.0  # a wait's bound in the failure tests: short, and far above any healthy wait


@pytest.fixture(scope="module")
def mailboxes():
    boxes = {}
    yield lambda tp: boxes.setdefault(tp, k3.Mailbox.virtual(jax.devices()[0], tp))
    for box in boxes.values():
        box.close()


def run(partials, mailbox, two_shot):
    return np.asarray(k3.all_reduce_virtual(jnp.asarray(partials), mailbox, two_shot=two_shot))


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
    mailbox = mailboxes(tp)
    before = mailbox.calls()
    for _ in range(2):  # two calls, fresh rows each: the mailbox's two buffers in turn
        partials = bf16(rng.standard_normal((tp, b, H), np.float32))
        assert_all_reduced(run(partials, mailbox, two_shot), partials, mailbox)
    assert mailbox.calls() == [c + 2 for c in before]  # every rank's counter, once per call


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
    got = run(partials, mailbox, two_shot)
    for r in range(tp):  # bit for bit, nan for nan; a sum of zeros may be +0 where fp32 gives -0
        same = (got[r].view(np.uint16) == want.view(np.uint16)) | (
            np.isnan(got[r].astype(np.float32)) & np.isnan(want.astype(np.float32))) | (
            (got[r].astype(np.float32) == 0) & (want.astype(np.float32) == 0))
        assert same.all(), f"rank {r}: {(~same).sum()} elements differ"
    assert (got[:, 0].astype(np.float32) == 0).all()  # the row of -0: zeros, and no hang
    assert not mailbox.timed_out() and mailbox.unarmed() == 0


@functools.partial(jax.jit, static_argnames=("mailbox", "batch", "two_shot"))
def stress_step(key, mailbox, *, batch, two_shot):
    """One step: fresh random partials, the all-reduce, mismatches against fp32 sums in rank
    order (bit-exact), and the unarmed words left after it."""
    from jax_kimik3.kernels import lamport_ops as lamport
    tp = mailbox.tp
    # reduce_precision: XLA keeps this rounding (it may skip a bf16 convert pair in a fusion).
    partials = jax.lax.reduce_precision(jax.random.normal(key, (tp, batch, H), jnp.float32),
                                        exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)
    got = k3.all_reduce_virtual(partials, mailbox, two_shot=two_shot)
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
    """10,000 steps dispatched without a host sync, random batch sizes: no mismatch, every
    slot re-armed."""
    mailbox = mailboxes(4)
    rng = np.random.default_rng(7)
    batches = rng.choice([1, 2, 5, 8, 17, 33, 64], 10_000)
    keys = jax.random.split(jax.random.key(0), 10_000)
    total = jnp.zeros((2,), jnp.int32)
    for step, batch in enumerate(batches):
        total = total + stress_step(keys[step], mailbox, batch=int(batch), two_shot=two_shot)
    mismatches, unarmed_left = map(int, total)
    assert (mismatches, unarmed_left) == (0, 0)
    assert not mailbox.timed_out()


def one_rank(rows, mailbox, rank, two_shot=False):
    """Rank `rank` alone, compiled: its all-reduce as a mesh rank would run it (R = 1), on the
    virtual mailbox, with nobody else publishing. Returns a function that runs it."""
    from jax_kimik3.kernels import lamport_ops
    table = jnp.asarray(mailbox.peer_table)
    compiled = jax.jit(lambda x, t: lamport_ops.all_reduce(
        x[None], t, jnp.full((1,), rank, jnp.int32), spec=mailbox.spec,
        two_shot=two_shot)).lower(rows, table).compile()
    return lambda: np.asarray(compiled(rows, table)[0].astype(jnp.float32))


def timed(f):
    """(f(), seconds it took)."""
    start = time.perf_counter()
    value = f()
    return value, time.perf_counter() - start


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_missing_then_late_peer_is_loud(two_shot):
    """Rank 0 all-reduces rows of 1 and rank 1 never comes: NaN rows (not rank 0's own rows)
    after the timeout, and the mailbox is marked failed. Rank 1 then publishes late (rows of
    2): NaN at once (it waits for nothing). The next call of both ranks (rows of 3): NaN on
    both (not 5 and 6: no stale sum). `check()` names rank 0, call 1 and rank 1; after `arm()`
    both ranks get 6 again and every slot is armed."""
    with k3.Mailbox.virtual(jax.devices()[0], 2, timeout_ms=TIMEOUT_MS) as mailbox:
        ones = jnp.ones((4, H), jnp.bfloat16)
        rank0 = one_rank(ones, mailbox, 0, two_shot)
        rank1 = one_rank(2 * ones, mailbox, 1, two_shot)
        first, waited = timed(rank0)
        assert np.isnan(first).all(), "the waiting rank must get NaN rows"
        assert waited >= TIMEOUT_MS / 1e3
        with pytest.raises(TimeoutError, match=r"rank 0 \((all-reduce consumer|two-shot owner)\) "
                                               r"gave up in call 1 since arm\(\) waiting for "
                                               r"rows of rank\(s\) \[1\]"):
            mailbox.check()
        late, waited = timed(rank1)
        assert np.isnan(late).all() and waited < TIMEOUT_MS / 1e3, "a failed mailbox waits not"
        both = run(bf16(np.full((2, 4, H), 3.0)), mailbox, two_shot).astype(np.float32)
        assert np.isnan(both).all(), "every later call is NaN until the host re-arms"
        with pytest.raises(TimeoutError, match=r"marked failed: every call on this mailbox "
                                               r"writes NaN until Mailbox.arm\(\)"):
            mailbox.check()
        mailbox.arm()
        assert mailbox.timed_out() == [] and mailbox.unarmed() == 0 and mailbox.calls() == [0, 0]
        again = run(bf16(np.full((2, 4, H), 3.0)), mailbox, two_shot).astype(np.float32)
        assert (again == 6.0).all()
        mailbox.check()
        assert mailbox.unarmed() == 0


def test_timeout_bounds_every_wait(rng):
    """A longer bound waits longer: the bound is time (the GPU's global timer), not polls.
    Each bound's second wait is timed (after `arm()`): a process's first call also loads the
    kernels, once 0.1 s on a GPU shared with other test workers."""
    times = {}
    for timeout_ms in (50.0, 400.0):
        with k3.Mailbox.virtual(jax.devices()[0], 2, timeout_ms=timeout_ms) as mailbox:
            run = one_rank(jnp.ones((8, H), jnp.bfloat16), mailbox, 0)
            run()
            assert mailbox.timed_out() == [0]
            mailbox.arm()
            _, times[timeout_ms] = timed(run)
            assert mailbox.timed_out() == [0]
    assert times[50.0] >= 0.05 and times[400.0] >= 0.4 and times[400.0] < 60
    assert times[400.0] > 3 * times[50.0]


def test_odd_layer_count_and_shared_mailbox(rng, mailboxes):
    """Consecutive calls on one mailbox use alternate buffers whatever the caller does: three
    all-reduces in one jit (an odd count, as 93 layers are), two of them independent of each
    other, dispatched back to back ten times without a host sync: all exact, every slot armed,
    every rank's counter advanced once per call."""
    mailbox = mailboxes(4)
    parts = [bf16(rng.standard_normal((4, 8, H), np.float32)) for _ in range(3)]

    @jax.jit
    def step(a, b, c):
        x = k3.all_reduce_virtual(a, mailbox)
        y = k3.all_reduce_virtual(b, mailbox)  # independent of x: XLA may order them freely
        z = k3.all_reduce_virtual(c + 0 * x[0], mailbox)
        return x, y, z

    before = mailbox.calls()
    outs = [step(*parts) for _ in range(10)]
    for x, y, z in outs:
        for got, partials in zip((x, y, z), parts):
            assert_all_reduced(np.asarray(got), partials, mailbox)
    assert mailbox.calls() == [c + 30 for c in before]


STALE_TABLE = """
    import jax, jax.numpy as jnp, numpy as np
    import jax_kimik3 as k3
    rows = jnp.ones((2, 4, k3.KIMI_K3.hidden_size), jnp.bfloat16)
    old = k3.Mailbox.virtual(jax.devices()[0], 2)
    spec, table, addresses = old.spec, old.peer_table.copy(), set(old.addresses)
    reduce = jax.jit(lambda rows, table: k3.all_reduce_virtual(rows, spec, peer_table=table))
    print("live table:", float(np.asarray(reduce(rows, table), np.float32).min()), flush=True)
    old.close()
    new = k3.Mailbox.virtual(jax.devices()[0], 2)
    print("a later mailbox reuses", len(addresses & set(new.addresses)), "addresses", flush=True)
    print("stale table:", float(np.asarray(reduce(rows, table), np.float32).min()), flush=True)
"""


def test_a_stale_peer_table_faults():
    """A peer table kept past its mailbox's close, handed to the all-reduce again after a new
    mailbox was made: the closed mailbox's address ranges stay reserved (jax_kimik3/mailbox.py,
    `_free`), so the new one lies elsewhere and the kernel faults (an illegal address, fatal
    to its process, hence a child process) instead of summing in the new mailbox's slots."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(STALE_TABLE)],
                            capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "live table: 2.0" in result.stdout, result.stderr[-2000:]
    assert "a later mailbox reuses 0 addresses" in result.stdout
    assert "stale table:" not in result.stdout and result.returncode != 0
    assert re.search(r"illegal (memory access|address)|ILLEGAL_ADDRESS", result.stderr), \
        result.stderr[-2000:]
