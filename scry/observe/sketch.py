"""Hot data: which tables and which lookup values are busiest right now.

A Count-Min Sketch (``depth`` rows of ``width`` counters) estimates how often
each key was seen: an estimate is never below the true count, and above it by
at most ``2 * N / width`` with probability ``1 - 2**-depth`` (N = total count).
A Top-K table keeps the ``k`` keys with the largest estimates. Every
``decay_seconds`` all counters are halved, so the view follows the present.
Memory is fixed: ``width * depth`` counters plus ``k`` entries per sketch.

Keys are hashed once into a digest of ``4 * depth`` bytes; each row takes 32
bits of it as its index. Lookup values are hashed with the anonymization key
(``table.column``, NUL, value), so the sketch and its output hold no raw value:
a hot value shows as ``pgbench_accounts.aid = #k7q2b6…``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import blake3

from scry.observe.anonymize import Anonymizer, short_token


class CountMinSketch:
    """Counters that overestimate but never underestimate."""

    __slots__ = ("width", "depth", "_rows", "total")

    def __init__(self, width: int = 2048, depth: int = 4) -> None:
        self.width = width
        self.depth = depth
        self._rows = [[0] * width for _ in range(depth)]
        self.total = 0

    def indexes(self, digest: bytes) -> tuple[int, ...]:
        """Row indexes of a key from its digest (at least 4 * depth bytes)."""
        x = int.from_bytes(digest, "little")
        w = self.width
        return tuple((x >> (32 * i) & 0xFFFFFFFF) % w for i in range(self.depth))

    def add(self, indexes: tuple[int, ...], count: int = 1) -> int:
        """Count a key; returns its new estimate."""
        self.total += count
        estimate = -1
        for row, i in zip(self._rows, indexes, strict=True):
            value = row[i] + count
            row[i] = value
            if estimate < 0 or value < estimate:
                estimate = value
        return estimate

    def estimate(self, indexes: tuple[int, ...]) -> int:
        """The estimated count of a key."""
        return min(row[i] for row, i in zip(self._rows, indexes, strict=True))

    def halve(self) -> None:
        """Decay: halve every counter."""
        for row in self._rows:
            row[:] = [v >> 1 for v in row]
        self.total >>= 1


class TopK:
    """The ``k`` keys with the largest estimates, with a label each."""

    __slots__ = ("k", "counts", "labels", "_min_key", "_min_value")

    def __init__(self, k: int) -> None:
        self.k = k
        self.counts: dict[Hashable, int] = {}
        self.labels: dict[Hashable, Any] = {}
        self._min_key: Hashable | None = None
        self._min_value = 0

    def offer(self, key: Hashable, estimate: int, label: Callable[[], Any]) -> None:
        """Tell the table a key's new estimate; ``label()`` is called on entry."""
        counts = self.counts
        if key in counts:
            counts[key] = estimate
            if key == self._min_key:
                self._min_key = None  # the minimum may have moved: find it lazily
            return
        if len(counts) < self.k:
            counts[key] = estimate
            self.labels[key] = label()
            self._min_key = None
            return
        if self._min_key is None:
            self._find_min()
        if estimate <= self._min_value:
            return
        del counts[self._min_key], self.labels[self._min_key]
        counts[key] = estimate
        self.labels[key] = label()
        self._find_min()

    def _find_min(self) -> None:
        self._min_key = min(self.counts, key=self.counts.__getitem__)
        self._min_value = self.counts[self._min_key]

    def halve(self) -> None:
        """Decay: halve every kept estimate."""
        for key in self.counts:
            self.counts[key] >>= 1
        self._min_key = None

    def items(self, limit: int | None = None) -> list[tuple[Any, int]]:
        """(label, estimate), largest first."""
        ranked = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return [(self.labels[key], count) for key, count in ranked[:limit]]


class HotData:
    """Hot tables and hot lookup values: one sketch and one top-k each."""

    def __init__(
        self,
        anonymizer: Anonymizer,
        *,
        top_k: int = 50,
        width: int = 2048,
        depth: int = 4,
        decay_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._anonymizer = anonymizer
        self.tables = CountMinSketch(width, depth)
        self.values = CountMinSketch(width, depth)
        self.top_tables = TopK(top_k)
        self.top_values = TopK(top_k)
        self.decay_seconds = decay_seconds
        self._clock = clock
        self._next_decay = clock() + decay_seconds
        self._digest_len = 4 * depth
        self._table_indexes: dict[str, tuple[int, ...]] = {}

    def add_table(self, table: str) -> None:
        """Count one use of a table."""
        idx = self._table_indexes.get(table)
        if idx is None:
            if len(self._table_indexes) > 100_000:
                self._table_indexes.clear()
            digest = blake3.blake3(table.encode("utf-8", "surrogatepass")).digest(self._digest_len)
            idx = self._table_indexes[table] = self.tables.indexes(digest)
        self.top_tables.offer(table, self.tables.add(idx), lambda: table)

    def add_value(self, column: str, literal: bytes | str) -> None:
        """Count one lookup of ``column`` (``table.column``) by a literal token."""
        if isinstance(literal, str):
            literal = literal.encode("utf-8", "surrogatepass")
        if literal[:1] == b"'":
            literal = literal[1:-1]
        digest = self._anonymizer.digest(
            column.encode("utf-8", "surrogatepass") + b"\0" + literal, self._digest_len
        )
        estimate = self.values.add(self.values.indexes(digest))
        self.top_values.offer(digest, estimate, lambda: (column, f"#{short_token(digest)}…"))

    def maybe_decay(self, now: float | None = None) -> bool:
        """Halve everything if a decay interval passed; True if it did."""
        now = self._clock() if now is None else now
        if now < self._next_decay:
            return False
        self._next_decay = now + self.decay_seconds
        for part in (self.tables, self.values, self.top_tables, self.top_values):
            part.halve()
        return True

    def hot(self, limit: int = 20) -> dict[str, list[dict[str, Any]]]:
        """The hottest tables and lookup values with estimated counts."""
        return {
            "tables": [
                {"table": name, "count": count} for name, count in self.top_tables.items(limit)
            ],
            "values": [
                {"column": column, "value": token, "count": count}
                for (column, token), count in self.top_values.items(limit)
            ],
        }
