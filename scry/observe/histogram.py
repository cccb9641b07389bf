"""A log-bucketed latency histogram (HDR-like): fixed relative error, bounded size.

Values are non-negative integers (microseconds). Values below 64 have a
bucket each; above, every power-of-two range is cut into 32 equal buckets,
so a bucket is at most 1/32 of its lower bound wide and its midpoint is
within 1/64 (1.6 %) of any value in it. Up to 2**40 µs (12 days) that is at
most 1,184 buckets; a histogram is a sparse ``dict`` bucket -> count, so it
holds only the buckets that were hit and never more than that bound.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable

SUB_BITS = 5
_DIRECT = 1 << (SUB_BITS + 1)  # 64: values below have their own bucket
_MAX_VALUE = (1 << 40) - 1
#: Worst relative error of ``bucket_value`` for values >= 64.
RELATIVE_ERROR = 1 / (1 << (SUB_BITS + 1))


def bucket_of(value: int) -> int:
    """Bucket index of a value in µs (clamped to [0, 2**40))."""
    if value < _DIRECT:
        return value if value > 0 else 0
    if value > _MAX_VALUE:
        value = _MAX_VALUE
    shift = value.bit_length() - SUB_BITS - 1
    return (shift << SUB_BITS) + (value >> shift)


def bucket_bounds(index: int) -> tuple[int, int]:
    """[low, high) of the values in a bucket."""
    if index < _DIRECT:
        return index, index + 1
    shift = (index >> SUB_BITS) - 1
    low = (index - (shift << SUB_BITS)) << shift
    return low, low + (1 << shift)


def bucket_value(index: int) -> float:
    """The representative value of a bucket: its midpoint (exact below 64)."""
    if index < _DIRECT:
        return float(index)
    low, high = bucket_bounds(index)
    return (low + high - 1) / 2


def percentiles(counts: dict[int, int], quantiles: Iterable[float]) -> list[float]:
    """Nearest-rank percentiles (0 < q <= 1) of a sparse histogram, in µs."""
    qs = list(quantiles)
    total = sum(counts.values())
    if total == 0:
        return [0.0 for _ in qs]
    order = sorted(counts.items())
    out = []
    for q in qs:
        rank = max(1, math.ceil(q * total - 1e-9))
        seen = 0
        for index, count in order:
            seen += count
            if seen >= rank:
                out.append(bucket_value(index))
                break
    return out


def add_sorted_ns(counts: dict[int, int], values: list[int]) -> None:
    """Count sorted durations in nanoseconds as ``bucket_of(ns // 1000)`` would,
    with one bisect per bucket hit instead of arithmetic per value."""
    i, n = 0, len(values)
    while i < n:
        us = values[i] // 1000
        if us < _DIRECT:
            bucket = us if us > 0 else 0
            high = bucket + 1
        elif us >= _MAX_VALUE:
            bucket = bucket_of(_MAX_VALUE)
            counts[bucket] = counts.get(bucket, 0) + n - i
            return
        else:
            shift = us.bit_length() - SUB_BITS - 1
            top = us >> shift
            bucket = (shift << SUB_BITS) + top
            high = (top + 1) << shift
        j = bisect_left(values, high * 1000, i)
        counts[bucket] = counts.get(bucket, 0) + j - i
        i = j


def merge_into(target: dict[int, int], source: dict[int, int]) -> None:
    """Add the counts of ``source`` to ``target``."""
    for index, count in source.items():
        target[index] = target.get(index, 0) + count


class LogHistogram:
    """A standalone histogram; the stats table inlines the same arithmetic."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def add(self, value: int) -> None:
        """Count one value (µs)."""
        index = bucket_of(value)
        self.counts[index] = self.counts.get(index, 0) + 1
        self.total += 1

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile in µs (0 < q <= 1)."""
        return percentiles(self.counts, (q,))[0]
