"""Latency histograms of ``/api/v1/queries/top?histogram=true``, added up.

The largest of several proxies' p99s only bounds the fleet's p99. Their
histograms add up instead: every scry buckets latencies alike and sends each
bucket as the value (ms) its own percentiles would take, so equal values are
the same bucket, and the fleet's percentiles are read off the sum by nearest
rank, as a proxy reads its own.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate

__all__ = ["add_histograms", "percentiles"]

Histogram = Sequence[tuple[float, int]]


def add_histograms(histograms: Iterable[Histogram]) -> list[tuple[float, int]]:
    """The sum of several histograms, ascending."""
    counts: dict[float, int] = {}
    for histogram in histograms:
        for value, count in histogram:
            counts[value] = counts.get(value, 0) + count
    return sorted(counts.items())


def percentiles(histogram: Histogram, quantiles: Iterable[float]) -> list[float]:
    """Nearest-rank percentiles (0 < q <= 1) of an ascending histogram; 0 if empty."""
    cumulative = list(accumulate(count for _, count in histogram))
    if not cumulative or cumulative[-1] <= 0:
        return [0.0 for _ in quantiles]
    total = cumulative[-1]
    return [
        histogram[bisect_left(cumulative, max(1, math.ceil(q * total - 1e-9)))][0]
        for q in quantiles
    ]
