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

import base64
import operator
import struct
import time
from array import array
from collections.abc import Callable, Hashable
from typing import Any

import blake3

from scry.observe.anonymize import Anonymizer, short_token


class CountMinSketch:
    """Counters that overestimate but never underestimate.

    The ``depth`` rows live in one flat array of int64; a key's indexes are
    absolute positions in it (row * width + column), so an update is a few
    index operations with no per-row bookkeeping (and the compiled drain,
    ``scry.observe._hot``, writes the cells directly).
    """

    __slots__ = ("width", "depth", "_counts", "_unpack", "_offsets", "total")

    def __init__(self, width: int = 2048, depth: int = 4) -> None:
        self.width = width
        self.depth = depth
        self._counts = array("q", bytes(8 * width * depth))
        self._unpack = struct.Struct(f"<{depth}I").unpack
        self._offsets = tuple(range(0, width * depth, width))
        self.total = 0

    def indexes(self, digest: bytes) -> list[int]:
        """A key's counter positions from its digest (4 * depth bytes)."""
        w = self.width
        return [v % w + o for v, o in zip(self._unpack(digest), self._offsets)]  # noqa: B905

    def add(self, indexes: list[int], count: int = 1) -> int:
        """Count a key; returns its new estimate."""
        counts = self._counts
        for i in indexes:
            counts[i] += count
        self.total += count
        return min(map(counts.__getitem__, indexes))

    def add_digest(self, digest: bytes, count: int = 1) -> int:
        """``add(indexes(digest))`` in one pass (the per-value path)."""
        counts = self._counts
        w = self.width
        estimate = -1
        for v, offset in zip(self._unpack(digest), self._offsets):  # noqa: B905
            i = v % w + offset
            c = counts[i] + count
            counts[i] = c
            if c < estimate or estimate < 0:
                estimate = c
        self.total += count
        return estimate

    def estimate(self, indexes: list[int]) -> int:
        """The estimated count of a key."""
        return min(map(self._counts.__getitem__, indexes))

    def halve(self) -> None:
        """Decay: halve every counter."""
        self._counts[:] = array("q", [v >> 1 for v in self._counts])
        self.total >>= 1

    # --- merging across workers (scry.adminapi.fleet) ---------------------------

    def export(self) -> dict[str, Any]:
        """The counters in mergeable, JSON-able form (int64 in native byte
        order, base64: the workers of an instance share a host)."""
        return {
            "width": self.width,
            "depth": self.depth,
            "total": self.total,
            "counts": base64.b64encode(self._counts.tobytes()).decode("ascii"),
        }

    @classmethod
    def merged(cls, exports: list[dict[str, Any]]) -> CountMinSketch:
        """A sketch whose counters are the cell-wise sums of exported sketches.
        Count-Min sketches of equal shape (and hashing) merge exactly so: the
        result is the sketch of all their keys. ValueError if shapes differ."""
        if not exports:
            return cls()
        sketch = cls(int(exports[0]["width"]), int(exports[0]["depth"]))
        counts = sketch._counts
        for exported in exports:
            if (exported["width"], exported["depth"]) != (sketch.width, sketch.depth):
                raise ValueError("count-min sketches of different shapes do not merge")
            cells = array("q")
            cells.frombytes(base64.b64decode(exported["counts"]))
            counts[:] = array("q", map(operator.add, counts, cells))
            sketch.total += int(exported["total"])
        return sketch

    def estimate_digest(self, digest: bytes) -> int:
        """The estimated count of a key from its digest (at least 4 * depth bytes)."""
        w = self.width
        values = struct.unpack_from(f"<{self.depth}I", digest)
        return min(self._counts[v % w + o] for v, o in zip(values, self._offsets))  # noqa: B905


class TopK:
    """The ``k`` keys with the largest estimates, with a label each."""

    __slots__ = ("k", "counts", "labels", "_min_key", "_min_value")

    def __init__(self, k: int) -> None:
        self.k = k
        self.counts: dict[Hashable, int] = {}
        self.labels: dict[Hashable, Any] = {}
        self._min_key: Hashable | None = None
        self._min_value = 0

    def offer(self, key: Hashable, estimate: int) -> bool:
        """Tell the table a key's new estimate. True when the key was just
        admitted: the caller then sets ``labels[key]``."""
        counts = self.counts
        if key in counts:
            counts[key] = estimate
            if key == self._min_key:
                self._min_key = None  # the minimum may have moved: find it lazily
            return False
        if len(counts) < self.k:
            counts[key] = estimate
            self._min_key = None
            return True
        if self._min_key is None:
            self._find_min()
        if estimate <= self._min_value:
            return False
        del counts[self._min_key], self.labels[self._min_key]
        counts[key] = estimate
        self._find_min()
        return True

    def floor(self) -> int | None:
        """The estimate a new key must beat to be admitted, when known
        without a scan; None when the table is not full (or the minimum is
        not known)."""
        if self._min_key is None or len(self.counts) < self.k:
            return None
        return self._min_value

    def admission_floor(self) -> int:
        """The estimate a new key must beat to be admitted: the table's
        minimum when it is full (found now if need be), else -1."""
        if len(self.counts) < self.k:
            return -1
        if self._min_key is None:
            self._find_min()
        return self._min_value

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
        self._table_indexes: dict[str, list[int]] = {}
        self._column_prefix: dict[str, bytes] = {}
        self._digest = anonymizer.digest
        self._hasher = anonymizer.hasher()

    def add_table(self, table: str, count: int = 1) -> None:
        """Count ``count`` uses of a table (the pipeline adds up per drain)."""
        idx = self._table_indexes.get(table)
        if idx is None:
            if len(self._table_indexes) > 100_000:
                self._table_indexes.clear()
            digest = blake3.blake3(table.encode("utf-8", "surrogatepass")).digest(self._digest_len)
            idx = self._table_indexes[table] = self.tables.indexes(digest)
        if self.top_tables.offer(table, self.tables.add(idx, count)):
            self.top_tables.labels[table] = table

    def add_value(self, column: str, literal: bytes | str) -> None:
        """Count one lookup of ``column`` (``table.column``) by a literal token."""
        if isinstance(literal, str):
            literal = literal.encode("utf-8", "surrogatepass")
        if literal[:1] == b"'":
            literal = literal[1:-1]
        prefix = self._column_prefix.get(column)
        if prefix is None:
            if len(self._column_prefix) > 100_000:
                self._column_prefix.clear()
            prefix = self._column_prefix[column] = column.encode("utf-8", "surrogatepass") + b"\0"
        self.add_values({prefix + literal: 1})

    def add_values(self, counts: dict[bytes, int]) -> None:
        """Count lookup values given as ``fingerprint.value_key`` -> count
        (``b"table.column\0value"``; the pipeline adds up one drain's worth).
        Each key is hashed once with the anonymization key; only the digest
        is kept."""
        # One keyed hasher, reset before each value (twice as fast as a copy
        # of a fresh one: no 2 KB state to clone).
        cms = self.values
        top = self.top_values
        offer = top.offer
        if cms.depth == 4 and self._digest_len <= 32:  # the default shape: compiled
            floor = top.admission_floor()
            candidates = _count_digests(counts, self._hasher, cms._counts, cms.width, floor)
            floor = top.floor()
            for digest, key, estimate in candidates:
                # At or under the floor the key cannot be one the table keeps
                # (a kept key's estimate never falls below what the table
                # holds for it, and that is at least the floor): not admitted.
                if floor is not None and estimate <= floor:
                    continue
                if offer(digest, estimate):
                    top.labels[digest] = self._value_label(key, digest)
                floor = top.floor()
            cms.total += sum(counts.values())
            return
        hasher = self._hasher
        reset, update, finish = hasher.reset, hasher.update, hasher.digest
        length = self._digest_len
        full = length <= 32  # digest() without a length: 32 bytes, the cheapest call
        cells = cms._counts
        unpack = struct.Struct(f"<{cms.depth}I").unpack_from
        width = cms.width
        offsets = cms._offsets
        floor = top.floor()
        for key, count in counts.items():
            reset()
            update(key)
            digest = finish() if full else finish(length=length)
            estimate = -1
            for v, offset in zip(unpack(digest), offsets):  # noqa: B905
                i = v % width + offset
                c = cells[i] + count
                cells[i] = c
                if c < estimate or estimate < 0:
                    estimate = c
            if floor is not None and estimate <= floor:
                continue  # not admitted (see above)
            if offer(digest, estimate):
                top.labels[digest] = self._value_label(key, digest)
            floor = top.floor()
        cms.total += sum(counts.values())

    @staticmethod
    def _value_label(key: bytes, digest: bytes) -> tuple[str, str]:
        column = key[: key.index(b"\0")].decode("utf-8", "surrogatepass")
        return column, f"#{short_token(digest)}…"

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

    def export(self) -> dict[str, Any]:
        """Both sketches and the keys of both top-k tables, for ``merge_hot``."""
        return {
            "tables": self.tables.export(),
            "values": self.values.export(),
            "top_tables": list(self.top_tables.labels),
            "top_values": [
                [digest.hex(), column, token]
                for digest, (column, token) in self.top_values.labels.items()
            ],
        }


def _py_count_digests(
    counts: dict[bytes, int], hasher: Any, cells: array[int], width: int, floor: int
) -> list[tuple[bytes, bytes, int]]:
    """The reference of ``scry.observe._hot.count_digests``: hash each key
    of ``counts`` with ``hasher`` (reset before each), add its count to its
    four cells (rows of ``width`` in ``cells``) and return ``[(digest, key,
    estimate)]`` for the keys whose estimate is above ``floor``."""
    reset, update, finish = hasher.reset, hasher.update, hasher.digest
    unpack = struct.Struct("<4I").unpack_from
    offset2, offset3 = 2 * width, 3 * width
    candidates = []
    for key, count in counts.items():
        reset()
        update(key)
        digest = finish()
        a, b, c, d = unpack(digest)
        a %= width
        b = b % width + width
        c = c % width + offset2
        d = d % width + offset3
        cells[a] = estimate = cells[a] + count
        cells[b] = cb = cells[b] + count
        cells[c] = cc = cells[c] + count
        cells[d] = cd = cells[d] + count
        estimate = min(estimate, cb, cc, cd)
        if estimate > floor:
            candidates.append((digest, key, estimate))
    return candidates


try:  # the compiled twin, built by setup.py when a C compiler is at hand
    from scry.observe._hot import count_digests as _compiled_count_digests
except ImportError:
    _compiled_count_digests = None

_count_digests = _compiled_count_digests or _py_count_digests


def table_digest(table: str, length: int) -> bytes:
    """The sketch digest of a table name (``HotData.add_table`` hashes so)."""
    return blake3.blake3(table.encode("utf-8", "surrogatepass")).digest(length)


def merge_hot(exports: list[dict[str, Any]], limit: int) -> dict[str, list[dict[str, Any]]]:
    """``HotData.hot`` of several workers: their sketches added cell-wise, and
    the union of their top-k keys re-ranked by the merged estimates."""
    tables = CountMinSketch.merged([e["tables"] for e in exports])
    values = CountMinSketch.merged([e["values"] for e in exports])
    length = 4 * tables.depth
    names = {name for e in exports for name in e["top_tables"]}
    hot_tables = sorted(
        ((tables.estimate_digest(table_digest(n, length)), n) for n in names),
        key=lambda item: (-item[0], item[1]),
    )
    labels = {digest: (column, token) for e in exports for digest, column, token in e["top_values"]}
    hot_values = sorted(
        ((values.estimate_digest(bytes.fromhex(d)), label) for d, label in labels.items()),
        key=lambda item: (-item[0], item[1]),
    )
    return {
        "tables": [{"table": name, "count": count} for count, name in hot_tables[:limit]],
        "values": [
            {"column": column, "value": token, "count": count}
            for count, (column, token) in hot_values[:limit]
        ],
    }
