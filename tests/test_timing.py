"""The benchmarks' profile bookkeeping (benchmarks/timing.py) on synthetic kernel events."""

import pytest

from benchmarks.timing import GAP_US, _runs, _timeline


def chain(start, calls):
    """One run of a chain of `calls` calls: a producer [0, 8], a consumer [1, 12] and an
    add [12.5, 13] per call, calls 20 µs apart; one warm-up kernel of its own at the start."""
    events = [(start - 5.0, start - 4.0, "warmup")]
    for c in range(calls):
        t = start + 20.0 * c
        events += [(t, t + 8.0, "producer"), (t + 1.0, t + 12.0, "consumer"),
                   (t + 12.5, t + 13.0, "add")]
    return events


def test_runs_split_at_idle_gaps():
    events = chain(0.0, 3) + chain(2 * GAP_US, 3)
    runs = _runs(sorted(events))
    assert [len(run) for run in runs] == [10, 10]
    assert runs[1][0] == (2 * GAP_US - 5.0, 2 * GAP_US - 4.0, "warmup")


def test_timeline_gives_each_kernel_its_place_in_the_call():
    runs = _runs(sorted(chain(0.0, 3) + chain(2 * GAP_US, 3)))
    timeline = _timeline(runs, 3)
    assert list(timeline) == ["producer", "consumer", "add"]  # the warm-up runs once, not per call
    assert timeline["producer"] == pytest.approx((0.0, 8.0))
    assert timeline["consumer"] == pytest.approx((1.0, 12.0))
    assert timeline["add"] == pytest.approx((12.5, 13.0))


def test_timeline_is_empty_without_a_kernel_that_runs_once_per_call():
    run = [(0.0, 1.0, "half"), (1.0, 2.0, "half"), (5.0, 6.0, "half"), (6.0, 7.0, "half")]
    assert _timeline([run], 2) == {}
