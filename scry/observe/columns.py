"""A drained chunk of query records, column by column.

The drain reads every record three times: once for the chunk's variants
(``chunk_variants``, then ``group_records``), once per shape group for
statistics (``group_columns``) and once for the chunk's events
(``event_columns``).
Both walk the records field by field and do the timeline arithmetic; in
Python that is a dozen whole-column passes (``map`` over ``itemgetter``,
``sub``, ``floordiv``), in C (``scry/observe/_columns.pyx``, built when a C
compiler was at hand) it is one pass with no intermediate lists. The
functions here are the reference: the compiled ones take the same arguments
and return equal values (tests/unit/test_observe_columns.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from itertools import repeat
from operator import add, floordiv, itemgetter, sub, truediv
from typing import Any

from scry.observe.fingerprint import DIGITS_TO_ZERO
from scry.observe.record import QueryRecord

_FIELDS = tuple(map(itemgetter, range(9)))
_TEXT = _FIELDS[1]
_CONTEXT_FIELDS = tuple(map(itemgetter, range(5)))


def py_group_columns(recs: list[QueryRecord], tag_rows: Mapping[Any, int]) -> tuple[Any, ...]:
    """``(databases, totals, queues, backends, acquires, sqlstates, pins,
    errors, rows, first_done, min_done, max_done, total_sum, shortest,
    longest, queue_sum, backend_sum, one_database)`` of a non-empty group.

    Durations are in ns, one per record: total = done - received, queue =
    acquired - received, backend = done - sent, acquire = sent - acquired
    (``acquires`` is None when every one is 0). Here they are lists of ints
    of any size; the compiled walk gives the same numbers as ``array('q')``s.
    ``pins`` is None when no record was pinned; ``rows`` adds up
    ``tag_rows[tag]``. The sums, the shortest and longest total and whether
    every record names the first record's database come with the columns:
    the drain would otherwise walk each list again (cold, live: each walk
    touches every int once more).
    """
    contexts, _, received, acquired, sent, done, tags, sqlstates, pins = [
        list(map(field, recs)) for field in _FIELDS
    ]  # (not zip(*recs): an iterator per record, enough to set off the collector)
    n = len(recs)
    databases = [context[1] for context in contexts]
    totals = list(map(sub, done, received))
    queues = list(map(sub, acquired, received))
    backends = list(map(sub, done, sent))
    return (
        databases,
        totals,
        queues,
        backends,
        None if sent == acquired else list(map(sub, sent, acquired)),
        sqlstates,
        None if pins.count(None) == n else pins,
        n - sqlstates.count(None),
        sum(map(tag_rows.__getitem__, tags)),
        done[0],
        min(done),
        max(done),
        sum(totals),
        min(totals),
        max(totals),
        sum(queues),
        sum(backends),
        databases.count(databases[0]) == n,
    )


def py_event_columns(
    batch: list[QueryRecord], tag_rows: Mapping[Any, int], wall_offset: float
) -> list[list[Any]]:
    """The columns of the chunk's events except fingerprint and query:
    ts, worker, client_id, database, user, application_name, queue_us,
    pool_acquire_us, backend_us, total_us, rows, sqlstate, pinned,
    pin_reasons (``EVENT_FIELDS`` order, those two left out). The numbers
    are arrays in the batch format's types (ts ``d``, the rest ``q``), so the
    encoder copies their bytes; the others are lists."""
    n = len(batch)
    contexts, _, received, acquired, sent, done, tags, sqlstates, pins = [
        list(map(field, batch)) for field in _FIELDS
    ]
    client_ids, databases, users, applications, workers = [
        list(map(field, contexts)) for field in _CONTEXT_FIELDS
    ]
    if pins.count(None) == n:
        pinned: list[bool] = [False] * n
        reasons: list[tuple[str, ...]] = [()] * n
    else:
        pinned = [p is not None for p in pins]
        reasons = [p or () for p in pins]
    thousand = repeat(1000)
    return [
        array("d", map(add, map(truediv, done, repeat(1e9)), repeat(wall_offset))),
        workers,
        client_ids,
        databases,
        users,
        applications,
        array("q", map(floordiv, map(sub, acquired, received), thousand)),
        array("q", bytes(8 * n))
        if sent == acquired
        else array("q", map(floordiv, map(sub, sent, acquired), thousand)),
        array("q", map(floordiv, map(sub, done, sent), thousand)),
        array("q", map(floordiv, map(sub, done, received), thousand)),
        array("q", map(tag_rows.__getitem__, tags)),
        sqlstates,
        pinned,
        reasons,
    ]


def py_chunk_variants(
    batch: list[QueryRecord], variants: dict[int, Any]
) -> tuple[list[bytes], list[int], list[Any]]:
    """``(texts, keys, found)`` of a chunk: each record's text, its variant
    key (``fingerprint.variant_key``: the hash of the text with its digits
    zeroed) and the cached variant under that key in ``variants`` (None
    when there is none)."""
    texts = list(map(_TEXT, batch))
    keys = list(map(hash, map(bytes.translate, texts, repeat(DIGITS_TO_ZERO))))
    return texts, keys, list(map(dict.get.__get__(variants), keys))  # type: ignore[attr-defined]


def py_group_records(variants: list[Any], batch: list[QueryRecord]) -> dict[Any, list[Any]]:
    """The records grouped by their variants (``variants[i]`` is the variant
    of ``batch[i]``), groups and records in the order they come."""
    if len(variants) != len(batch):
        raise ValueError("one variant per record")
    groups: dict[Any, list[Any]] = {}
    group_of = groups.get
    for variant, rec in zip(variants, batch, strict=True):
        group = group_of(variant)
        if group is None:
            groups[variant] = [rec]
        else:
            group.append(rec)
    return groups


try:  # the compiled twins, built by setup.py when a C compiler is at hand
    from scry.observe._columns import chunk_variants as _compiled_chunk_variants
    from scry.observe._columns import event_columns as _compiled_event_columns
    from scry.observe._columns import group_columns as _compiled_group_columns
    from scry.observe._columns import group_records as _compiled_group_records
except ImportError:
    _compiled_event_columns = _compiled_group_columns = None
    _compiled_chunk_variants = _compiled_group_records = None

group_columns = _compiled_group_columns or py_group_columns
event_columns = _compiled_event_columns or py_event_columns
chunk_variants = _compiled_chunk_variants or py_chunk_variants
group_records = _compiled_group_records or py_group_records
