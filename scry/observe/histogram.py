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
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import repeat

try:
    from _collections import (  # type: ignore[import-not-found]
        _count_elements as count_elements,  # what Counter.update runs, in C
    )
except ImportError:  # pragma: no cover - other interpreters

    def count_elements(mapping: dict, iterable: Iterable) -> None:  # type: ignore[type-arg]
        for element in iterable:
            mapping[element] = mapping.get(element, 0) + 1


__all__ = [
    "NS_BUCKETS",
    "RELATIVE_ERROR",
    "SUB_BITS",
    "BucketBounds",
    "LogHistogram",
    "add_ns",
    "bucket_bounds",
    "bucket_of",
    "bucket_value",
    "count_elements",
    "count_positions",
    "merge_into",
    "percentiles",
]

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


class BucketBounds:
    """Ascending bucket bounds, as a list (for ``bisect``) and as int64s
    (for the compiled count). Neither change to the int64s moves an int64's
    ``bisect_right`` position: the bounds no int64 reaches are left out, and
    those below every int64 are raised to the least."""

    __slots__ = ("lower", "int64")

    def __init__(self, lower: Sequence[int]) -> None:
        self.lower = list(lower)
        least = -(1 << 63)
        self.int64 = array("q", [max(b, least) for b in self.lower if b < 1 << 63])


def py_count_positions(values: Sequence[int], bounds: BucketBounds) -> dict[int, int]:
    """``{bisect_right(bounds.lower, v): how many v}`` over ``values`` (any
    order; one bisect each, in C: ``map`` and ``count_elements``)."""
    positions: dict[int, int] = {}
    count_elements(positions, map(bisect_right, repeat(bounds.lower, len(values)), values))
    return positions


def count_positions(values: Sequence[int], bounds: BucketBounds) -> dict[int, int]:
    """``py_count_positions``, compiled when it can be (``_histogram.pyx``:
    int64 values in a list or an ``array('q')``)."""
    if _compiled_count_positions is not None and (
        values.__class__ is list or values.__class__ is array
    ):
        try:
            return _compiled_count_positions(values, bounds.int64)
        except (OverflowError, TypeError):
            pass  # not all int64: the twin takes any number
    return py_count_positions(values, bounds)


def add_ns(
    counts: dict[int, int], values: Sequence[int], bounds: BucketBounds | None = None
) -> None:
    """Count durations in nanoseconds, in any order, as ``bucket_of(ns // 1000)``
    would. Buckets are numbered 0, 1, 2, ... in the order of their lower bounds
    (``bounds``: ``NS_BUCKETS`` unless given; any ascending bounds, the first
    bucket's first, ending with one above every value); values below the
    first count in bucket 0."""
    for position, count in count_positions(values, bounds or NS_BUCKETS).items():
        bucket = position - 1 if position > 0 else 0  # negative: counted as 0
        counts[bucket] = counts.get(bucket, 0) + count


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


# Lower bounds of every bucket in ns (a duration d counts as d // 1000 µs), and
# a sentinel above the last one (values beyond 2**40 µs are clamped into it).
_LOWER_NS = [bucket_bounds(b)[0] * 1000 for b in range(bucket_of(_MAX_VALUE) + 1)] + [1 << 80]
NS_BUCKETS = BucketBounds(_LOWER_NS)

try:  # the compiled twin (scry/observe/_histogram.pyx), when it was built
    from scry.observe._histogram import count_positions as _compiled_count_positions
except ImportError:  # pragma: no cover - no C compiler at install time
    _compiled_count_positions = None
