"""Latency histogram accuracy, the sliding window and LRU eviction."""

from __future__ import annotations

import math
import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.observe import histogram
from scry.observe.histogram import (
    NS_BUCKETS,
    RELATIVE_ERROR,
    BucketBounds,
    LogHistogram,
    add_ns,
    bucket_bounds,
    bucket_of,
    count_positions,
    percentiles,
    py_count_positions,
)
from scry.observe.stats import StatsTable


def _exact(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) - 1e-9)) - 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 40) - 1))
def test_bucket_contains_its_value(v: int) -> None:
    low, high = bucket_bounds(bucket_of(v))
    assert low <= v < high
    if v >= 64:
        assert (high - low) / low <= 2 * RELATIVE_ERROR


@pytest.mark.parametrize("seed", range(5))
def test_percentiles_within_error_bound(seed: int) -> None:
    rng = random.Random(seed)
    values = [int(rng.lognormvariate(7, 1.5)) for _ in range(20_000)]
    h = LogHistogram()
    for v in values:
        h.add(v)
    for q in (0.5, 0.95, 0.99, 0.999, 1.0):
        exact = _exact(values, q)
        got = h.percentile(q)
        assert abs(got - exact) <= max(0.5, exact * RELATIVE_ERROR), (q, got, exact)


def test_percentiles_of_empty_histogram() -> None:
    assert percentiles({}, (0.5, 0.99)) == [0.0, 0.0]


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_cumulative_and_window_stats() -> None:
    clock = Clock()
    table = StatsTable(100, clock=clock)
    for i in range(100):
        table.add("a", "SELECT a", clock.now, 1000 + i, 10, 990 + i, 1, i % 10 == 0)
    clock.now += 30
    for _ in range(10):
        table.add("b", "SELECT b", clock.now, 50_000, 0, 50_000, 0, False)
    (a,) = [r for r in table.top("calls", 10) if r["fingerprint"] == "a"]
    assert a["calls"] == 100 and a["errors"] == 10 and a["rows"] == 100
    assert a["min_ms"] == 1.0 and a["max_ms"] == 1.099
    assert a["mean_ms"] == pytest.approx(1.0495)
    assert a["queue_ms_mean"] == pytest.approx(0.010)
    assert abs(a["p50_ms"] - 1.049) <= 1.049 * RELATIVE_ERROR
    top = table.top("total_time", 10)
    assert [r["fingerprint"] for r in top] == ["b", "a"]
    assert sum(r["share"] for r in top) == pytest.approx(1.0)
    assert top[0]["first_seen"] == clock.now
    # 30 s later, a 10 s window only holds b
    assert [r["fingerprint"] for r in table.top("calls", 10, window_seconds=10)] == ["b"]
    assert {r["fingerprint"] for r in table.top("calls", 10, window_seconds=60)} == {"a", "b"}
    clock.now += 61  # everything leaves the window; cumulative stays
    assert table.top("calls", 10, window_seconds=60) == []
    assert len(table.top("calls", 10)) == 2
    summary = table.summary(60)
    assert summary["queries"] == 110 and summary["window_queries"] == 0 and summary["errors"] == 10


def test_window_ring_reuses_slots() -> None:
    clock = Clock(0.0)
    table = StatsTable(10, slot_seconds=5, slots=12, clock=clock)
    for second in range(0, 600):  # ten minutes, one call a second
        clock.now = float(second)
        table.add("a", "q", clock.now, 100, 0, 100, 0, False)
    (row,) = table.top("calls", 1, window_seconds=60)
    assert row["calls"] == 60
    (row,) = table.top("calls", 1, window_seconds=10)
    assert row["calls"] == 10
    assert table.summary(60)["qps"] == pytest.approx(1.0)


def test_rankings() -> None:
    table = StatsTable(10, clock=Clock())
    now = Clock()()
    table.add("many", "q", now, 10, 0, 10, 0, False)
    for _ in range(9):
        table.add("many", "q", now, 10, 0, 10, 0, False)
    table.add("slow", "q", now, 90_000, 0, 0, 0, False)
    table.add("bad", "q", now, 5, 0, 0, 0, True)
    for _ in range(50):
        table.add("tail", "q", now, 100, 0, 0, 0, False)
    table.add("tail", "q", now, 80_000, 0, 0, 0, False)
    assert table.top("calls", 1)[0]["fingerprint"] == "tail"
    assert table.top("mean", 1)[0]["fingerprint"] == "slow"
    assert table.top("errors", 1)[0]["fingerprint"] == "bad"
    assert table.top("p99", 2)[0]["fingerprint"] == "slow"
    assert table.top("total_time", 1)[0]["fingerprint"] == "slow"
    with pytest.raises(ValueError):
        table.top("nonsense")


def test_lru_eviction_is_counted_and_totals_stay_exact() -> None:
    clock = Clock()
    table = StatsTable(3, clock=clock)
    for name in "abc":
        table.add(name, name, clock.now, 100, 0, 100, 0, False)
    table.add("a", "a", clock.now, 100, 0, 100, 0, False)  # a is now the most recent
    table.add("d", "d", clock.now, 100, 0, 100, 0, False)  # evicts b, the least recent
    assert table.evicted == 1
    assert table.get("b") is None and table.get("a") is not None
    assert len(table) == 3
    summary = table.summary()
    assert summary["queries"] == 5 and summary["evicted_fingerprints"] == 1
    assert summary["window_queries"] == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-5_000, max_value=(1 << 42) * 1000), max_size=300))
def test_add_ns_counts_like_bucket_of(values: list[int]) -> None:
    counts: dict[int, int] = {}
    add_ns(counts, values)  # in any order
    expected: dict[int, int] = {}
    for v in values:
        b = bucket_of(min(max(v // 1000, 0), (1 << 40) - 1))
        expected[b] = expected.get(b, 0) + 1
    assert counts == expected


_INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


@pytest.mark.skipif(
    histogram._compiled_count_positions is None, reason="the extension was not built"
)
@settings(max_examples=300, deadline=None)
@given(
    st.lists(_INT64, max_size=200),
    st.lists(st.integers(min_value=-(1 << 64), max_value=1 << 80), max_size=40),
)
def test_compiled_count_positions_says_what_bisect_says(
    values: list[int], lower: list[int]
) -> None:
    bounds = BucketBounds(sorted(lower))
    expected = py_count_positions(values, bounds)
    assert histogram._compiled_count_positions(values, bounds.int64) == expected
    assert histogram._compiled_count_positions(array("q", values), bounds.int64) == expected


def test_count_positions_hands_what_is_not_int64_to_the_twin() -> None:
    values = [5_000, 1 << 70, -3, 2.5e6]
    assert count_positions(values, NS_BUCKETS) == py_count_positions(values, NS_BUCKETS)
    assert count_positions(tuple(values), NS_BUCKETS) == py_count_positions(values, NS_BUCKETS)
    doubles = array("d", [5_000, -3, 2.5e6])  # an array, but not of int64s
    assert count_positions(doubles, NS_BUCKETS) == py_count_positions(doubles, NS_BUCKETS)


def test_add_group_equals_adds() -> None:
    rng = random.Random(3)
    one, grouped = StatsTable(10), StatsTable(10)
    values = [int(rng.expovariate(1 / 500)) for _ in range(200)]
    for v in values:
        one.add("f", "q", 1_000.5, v, 3, v - 3, 2, v % 7 == 0)
    hist: dict[int, int] = {}
    for v in values:
        hist[bucket_of(v)] = hist.get(bucket_of(v), 0) + 1
    grouped.add_group(
        "f", "q", 1_000.5, 1_000.5, len(values), sum(v % 7 == 0 for v in values),
        2 * len(values), sum(values), 3 * len(values), sum(values) - 3 * len(values),
        min(values), max(values), hist,
    )  # fmt: skip
    assert one.top("calls", now=1_001) == grouped.top("calls", now=1_001)
    assert one.top("p99", window_seconds=5, now=1_001) == grouped.top(
        "p99", window_seconds=5, now=1_001
    )
