"""Hot data: which tables and which lookup values are busiest right now.

A Count-Min Sketch (``depth`` rows of ``width`` counters) estimates how often
each key was seen: an estimate is never below the true count, and above it by
at most ``2 * N / width`` with probability ``1 - 2**-depth`` (N = total count).
A Top-K table keeps the ``k`` keys with the largest estimates. Every
``decay_seconds`` all counters are halved, so the view follows the present.
Memory is fixed: ``width * depth`` counters plus ``k`` entries per sketch.

A table name is hashed once into a digest of ``4 * depth`` bytes; each row
takes 32 bits of it as its index. A lookup value (``table.column``, NUL,
value) finds its cells by ``RowHash``, keyed from the anonymization key, and
only a value that may enter the Top-K gets its keyed Blake3 digest, which is
what the table keeps and shows: the sketch and its output hold no raw value,
and a hot value shows as ``pgbench_accounts.aid = #k7q2b6…``.
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


# The Mersenne prime 2**61 - 1: the field RowHash computes in.
_P61 = (1 << 61) - 1
_ROW_SEED_CONTEXT = b"scry hot data count-min rows v1"


class RowHash:
    """Which cell a lookup value counts in, in each row of a sketch.

    A polynomial hash of the key's bytes (``_fold``: little-endian 32-bit
    words, the column prefix and the value each zero-padded, then the value's
    length) in a secret base modulo the prime 2**61 - 1, then one ``((a * h +
    b) mod p) mod width`` per row: the pairwise-independent family Count-Min's
    bounds are proved for. Two distinct keys of at most n words share ``h``
    with probability at most (n + 2) / 2**61. The prefix is a part of its own
    so the drain can hash a value where it sits in a query text
    (``count_spans``), carrying on from the prefix's polynomial.

    The base and each row's ``a, b`` come from the anonymization key, so the
    workers of one deployment put a value in the same cells (their sketches
    add up cell-wise) and without the key nobody can tell which cells a
    guessed value would touch. (It is not a PRF: someone who can both send
    queries and read the admin API might learn the seeds from where chosen
    values land; but they can already test a guess by sending it and
    comparing its hot-value token.) Hashing every value with keyed Blake3
    instead (its digest's words as the rows) cost 0.23 µs of the drain's
    ~0.5 per pgbench record; this costs a few multiplications.
    """

    __slots__ = ("seeds", "width")

    def __init__(self, anonymizer: Anonymizer, width: int, depth: int) -> None:
        words = struct.unpack(
            f"<{1 + 2 * depth}Q", anonymizer.digest(_ROW_SEED_CONTEXT, 8 * (1 + 2 * depth))
        )
        seeds = [words[0] % (_P61 - 1) + 1]  # the base: not 0
        for a, b in zip(words[1::2], words[2::2], strict=True):
            seeds += (a % (_P61 - 1) + 1, b % _P61)  # a: not 0
        self.seeds = array("Q", seeds)  # (the depth is how many a, b pairs)
        self.width = width

    def positions(self, key: bytes) -> list[int]:
        """The key's cell in each row, as positions in the sketch's cells."""
        return self.cells(_fold(key, self.seeds[0]))

    def cells(self, h: int) -> list[int]:
        """``positions`` from the key's polynomial (what ``count_keys`` gives)."""
        return _row_positions(self.seeds, h, self.width)


def _fold(key: bytes, base: int) -> int:
    """The key's polynomial: 1, then the words of the key up to and with its
    first NUL (the ``table.column`` prefix), then those of the rest (the
    value), each part zero-padded to whole words, then the value's length."""
    cut = key.find(b"\0") + 1 or len(key)
    return _finish(
        _fold_words(key[cut:], _fold_words(key[:cut], 1, base), base), len(key) - cut, base
    )


def _fold_words(data: bytes, h: int, base: int) -> int:
    for (word,) in struct.iter_unpack("<I", data + bytes(-len(data) % 4)):
        h = (h * base + word) % _P61
    return h


def _finish(h: int, value_length: int, base: int) -> int:
    return (h * base + value_length) % _P61


def _row_positions(seeds: array[int], h: int, width: int) -> list[int]:
    return [
        (a * h + b) % _P61 % width + row * width
        for row, (a, b) in enumerate(zip(seeds[1::2], seeds[2::2], strict=True))
    ]


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
        self._rows = RowHash(anonymizer, width, depth)
        self._table_indexes: dict[str, list[int]] = {}
        self._column_prefix: dict[str, bytes] = {}
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
        (``b"table.column\0value"``). Each key finds its cells by
        ``RowHash``; only the few whose estimate could enter the Top-K are
        hashed with the anonymization key, and only that digest is kept."""
        cms = self.values
        floor = self.top_values.admission_floor()
        self._offer(_count_keys(counts, self._rows.seeds, cms._counts, cms.width, floor))
        cms.total += sum(counts.values())

    def add_span_values(
        self, spanned: list[tuple[list[bytes], tuple[tuple[bytes, int, int], ...]]]
    ) -> None:
        """Count the lookup value at each span ``(prefix, start, end)`` of
        every text, for each ``(texts, spans)`` of ``spanned`` (the spans are
        ``fingerprint.Variant.spans``: the key is ``prefix +
        text[start:end]``), as ``add_values`` would count them, without
        making a key for every value."""
        cms = self.values
        floor = self.top_values.admission_floor()
        self._offer(_count_spans(spanned, self._rows.seeds, cms._counts, cms.width, floor))
        cms.total += sum(len(texts) * len(spans) for texts, spans in spanned)

    def _offer(self, candidates: dict[int, list[Any]]) -> None:
        """Offer the Top-K the keys whose estimates might enter it
        (``{h: [key, estimate]}``, ``h`` the key's ``RowHash`` polynomial)."""
        if not candidates:
            return
        top = self.top_values
        offer = top.offer
        # One keyed hasher, reset before each value (twice as fast as a copy
        # of a fresh one: no 2 KB state to clone).
        hasher = self._hasher
        reset, update, finish = hasher.reset, hasher.update, hasher.digest
        floor = top.floor()
        for h, (key, estimate) in candidates.items():
            # At or under the floor the key cannot be one the table keeps
            # (a kept key's estimate never falls below what the table holds
            # for it, and that is at least the floor): not admitted.
            if floor is not None and estimate <= floor:
                continue
            reset()
            update(key)
            digest = finish()
            if offer(digest, estimate):
                top.labels[digest] = self._value_label(key, digest, h)
            floor = top.floor()

    @staticmethod
    def _value_label(key: bytes, digest: bytes, h: int) -> tuple[str, str, int]:
        """(column, token, the key's polynomial): ``export`` turns the last
        into the key's cells, for ``merge_hot`` to re-estimate the value from
        the workers' merged sketch."""
        column = key[: key.index(b"\0")].decode("utf-8", "surrogatepass")
        return column, f"#{short_token(digest)}…", h

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
                for (column, token, _h), count in self.top_values.items(limit)
            ],
        }

    def export(self) -> dict[str, Any]:
        """Both sketches and the keys of both top-k tables, for ``merge_hot``."""
        return {
            "tables": self.tables.export(),
            "values": self.values.export(),
            "top_tables": list(self.top_tables.labels),
            "top_values": [
                [digest.hex(), column, token, self._rows.cells(h)]
                for digest, (column, token, h) in self.top_values.labels.items()
            ],
        }


def _py_count_keys(
    counts: dict[bytes, int], seeds: array[int], cells: array[int], width: int, floor: int
) -> dict[int, list[Any]]:
    """The reference of ``scry.observe._hot.count_keys``: add each key's
    count to its cell in each row of ``cells`` (``RowHash`` with ``seeds``)
    and return ``{h: [key, estimate]}`` for the keys whose estimate is above
    ``floor``, ``h`` being the key's polynomial (``RowHash.cells``)."""
    _check_shape(seeds, cells, width)
    candidates = {}
    for key, count in counts.items():
        if type(key) is not bytes:
            raise TypeError("a lookup value's key is bytes")
        h = _fold(key, seeds[0])
        estimate = _add_count(h, count, seeds, cells, width)
        if estimate > floor:
            candidates[h] = [key, estimate]
    return candidates


def _py_count_spans(
    spanned: list[tuple[list[bytes], tuple[tuple[bytes, int, int], ...]]],
    seeds: array[int],
    cells: array[int],
    width: int,
    floor: int,
) -> dict[int, list[Any]]:
    """The reference of ``scry.observe._hot.count_spans``: ``_py_count_keys``
    of ``prefix + text[start:end]`` for every span of every text of every
    ``(texts, spans)``, one at a time, span by span; a key met again keeps
    its latest estimate."""
    _check_shape(seeds, cells, width)
    base = seeds[0]
    candidates: dict[int, list[Any]] = {}
    for texts, spans in spanned:
        for prefix, start, end in spans:
            if type(prefix) is not bytes or start < 0 or end < 0:
                raise TypeError("a span is (bytes prefix, start, end)")
            if not prefix or prefix.find(b"\0") != len(prefix) - 1:
                raise ValueError("a span's prefix ends in its only NUL")
            h_prefix = _fold_words(prefix, 1, base)
            for text in texts:
                if type(text) is not bytes:
                    raise TypeError("a record's text is bytes")
                value = text[start:end]
                h = _finish(_fold_words(value, h_prefix, base), len(value), base)
                estimate = _add_count(h, 1, seeds, cells, width)
                if estimate > floor:
                    if h in candidates:
                        candidates[h][1] = estimate
                    else:
                        candidates[h] = [prefix + value, estimate]
    return candidates


def _check_shape(seeds: array[int], cells: array[int], width: int) -> None:
    if not (len(seeds) >= 3 and len(seeds) % 2 == 1):
        raise ValueError("seeds are a base and two numbers per row")
    if width <= 0 or len(cells) < (len(seeds) - 1) // 2 * width:
        raise ValueError("cells must hold depth rows of width counters")


def _add_count(h: int, count: int, seeds: array[int], cells: array[int], width: int) -> int:
    estimate = None
    for i in _row_positions(seeds, h, width):
        cells[i] = cell = cells[i] + count
        if estimate is None or cell < estimate:
            estimate = cell
    return estimate


try:  # the compiled twins, built by setup.py when a C compiler is at hand
    from scry.observe._hot import count_keys as _compiled_count_keys
    from scry.observe._hot import count_spans as _compiled_count_spans
except ImportError:
    _compiled_count_keys = _compiled_count_spans = None

_count_keys = _compiled_count_keys or _py_count_keys
_count_spans = _compiled_count_spans or _py_count_spans


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
    # One entry per value (its digest): (column, token, its cells).
    labels = {digest: (column, token, cells) for e in exports for digest, column, token, cells in e["top_values"]}  # fmt: skip
    hot_values = sorted(
        ((values.estimate(cells), (column, token)) for column, token, cells in labels.values()),
        key=lambda item: (-item[0], item[1]),
    )
    return {
        "tables": [{"table": name, "count": count} for count, name in hot_tables[:limit]],
        "values": [
            {"column": column, "value": token, "count": count}
            for count, (column, token) in hot_values[:limit]
        ],
    }
