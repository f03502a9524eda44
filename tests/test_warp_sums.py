"""CPU: the warp sum spread over lanes (primitives.warp_scatter_sums) and the cluster slots'
totals handed out by lane (primitives.slot_totals), on a model of the warp.

Both are plain Python over the DSL's select, shuffles and scalar types; here those act on a
numpy array of the 32 lanes' values, so their index bookkeeping is checked against plain sums."""

import types

import numpy as np
import pytest

pytest.importorskip("cutlass")

from jax_kimik3.kernels import primitives  # noqa: E402

LANES = np.arange(32)


@pytest.fixture
def warp_model(monkeypatch):
    """primitives' DSL operations replaced by their meaning on [32] lane arrays."""
    monkeypatch.setattr(primitives, "Float32", lambda x: np.broadcast_to(np.float64(x), 32) * 1)
    monkeypatch.setattr(primitives, "Int32", lambda x: np.broadcast_to(np.int64(x), 32) * 1)
    monkeypatch.setattr(primitives, "cutlass", types.SimpleNamespace(select_=np.where))
    monkeypatch.setattr(primitives, "cute", types.SimpleNamespace(arch=types.SimpleNamespace(
        shuffle_sync_bfly=lambda x, offset: x[LANES ^ offset],
        shuffle_sync=lambda x, offset: np.broadcast_to(x[offset], 32) * 1)))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 18, 28, 32, 33, 54])
def test_each_sum_lands_once_on_one_lane(warp_model, n):
    rng = np.random.default_rng(n)
    values = [rng.standard_normal(32) for _ in range(n)]
    stored = {}
    for total, index, stores in primitives.warp_scatter_sums(values, LANES):
        for lane in np.flatnonzero(stores & (index < n)):
            j = int(index[lane])
            assert j not in stored, f"value {j} stored by two lanes"
            stored[j] = total[lane]
    assert sorted(stored) == list(range(n))
    for j, got in stored.items():
        np.testing.assert_allclose(got, values[j].sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 18, 28, 31, 32, 33, 54])
def test_every_lane_gets_each_value_summed_in_rank_order(warp_model, n):
    rng = np.random.default_rng(n)
    slots = rng.standard_normal((7, n)).astype(np.float32)
    totals = primitives.slot_totals(slots, n, 7, LANES)
    assert len(totals) == n
    for k, got in enumerate(totals):
        want = np.float64(0.0)
        for c in range(7):  # rank order, as every CTA adds them
            want = want + slots[c, k]
        np.testing.assert_array_equal(got, np.broadcast_to(want, 32))
