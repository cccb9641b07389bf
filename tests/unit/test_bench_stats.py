"""The benchmark's same-round ratios and the interval it gives their median."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench  # type: ignore[import-not-found]  # noqa: E402


def exact_coverage(n: int, k: int) -> float:
    """P(the k-th smallest of n draws < median < the k-th largest), 1-indexed k."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize(
    ("n", "low", "high", "coverage"),
    [
        (5, 1, 5, exact_coverage(5, 1)),  # too few rounds for 95%: the range, 94%
        (6, 1, 6, exact_coverage(6, 1)),
        (9, 2, 8, exact_coverage(9, 2)),
        (12, 3, 10, exact_coverage(12, 3)),
        (16, 4, 13, exact_coverage(16, 4)),
    ],
)
def test_the_interval_is_the_narrowest_that_covers_95_percent(
    n: int, low: int, high: int, coverage: float
) -> None:
    values = [float(v) for v in random.Random(n).sample(range(1, 1000), n)]
    ordered = sorted(values)
    got = bench.median_interval(values)
    assert got == (ordered[low - 1], ordered[high - 1], pytest.approx(coverage))
    if n >= 6:
        assert coverage >= 0.95
        assert exact_coverage(n, low + 1) < 0.95  # one value fewer from each end would not do


def test_one_value_has_no_interval() -> None:
    assert bench.median_interval([1.0]) is None
    assert bench.fmt_paired([0.8]) == "0.80× [1 round]"
    assert bench.fmt_paired([]) == "-"


def test_the_interval_covers_the_median_as_often_as_it_says() -> None:
    rng = random.Random(7)
    n, trials, hits = 12, 4000, 0
    for _ in range(trials):
        low, high, _ = bench.median_interval([rng.gauss(1.0, 0.1) for _ in range(n)])  # type: ignore[misc]
        hits += low < 1.0 < high
    assert abs(hits / trials - exact_coverage(12, 3)) < 0.02


def result(target: str, rnd: int, tps: float | None, cpu: float = 10.0) -> bench.RunResult:
    return bench.RunResult(
        round=rnd, scenario="S10", target=target, kind="scry", ok=tps is not None, tps=tps,
        proxy_cpu_us_per_txn=cpu,
    )  # fmt: skip


def test_ratios_pair_runs_of_the_same_round_only() -> None:
    results = [
        result("base", 1, 100.0, 20.0),
        result("other", 1, 80.0, 25.0),
        result("base", 2, 200.0, 10.0),
        result("other", 2, 150.0, 12.0),
        result("other", 3, 90.0),  # no base run in round 3
        result("base", 4, None),  # a failed run pairs with nothing
        result("other", 4, 70.0),
    ]
    assert bench.paired_ratios(results, "S10", "other", "base") == [0.8, 0.75]
    assert bench.paired_ratios(results, "S10", "other", "base", "proxy_cpu_us_per_txn") == [
        1.25,
        1.2,
    ]


def test_host_steal_is_counted_busy_and_reported_apart() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    busy, steal = bench.cpu_line_ticks("cpu  100 5 40 9000 7 3 2 250 0 0\n")
    assert (busy, steal) == (100 + 5 + 40 + 3 + 2 + 250, 250)
    # An old kernel's line without the steal field.
    assert bench.cpu_line_ticks("cpu  100 5 40 9000 7 3 2") == (150, 0)
