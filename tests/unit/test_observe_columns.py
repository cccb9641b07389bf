"""The drain's column walks: the compiled twins say what the Python ones say."""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.observe import columns, fingerprint
from scry.observe.record import ClientContext

pytestmark = pytest.mark.skipif(
    columns._compiled_group_columns is None, reason="the extension was not built"
)

CONTEXTS = [
    ClientContext("c1", "app", "alice", "psql"),
    ClientContext("c2", "app", "bob", "", worker=3),
    ClientContext("c3", "other", "alice", "pgbench", worker=1),
]
TAGS = [b"SELECT 1\x00", b"UPDATE 7\x00", b"BEGIN\x00", 5, 0]

# Times as the proxy reads them (perf_counter_ns), and odd ones: out of order,
# negative spans (a clock that went back in a test), beyond 64 bits.
time_st = st.one_of(
    st.integers(min_value=0, max_value=10**13),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.integers(min_value=2**63, max_value=2**64),
)


@st.composite
def records(draw: Any) -> tuple:
    received, acquired, sent, done = (draw(time_st) for _ in range(4))
    if draw(st.booleans()):
        sent = acquired  # the usual case: written as soon as a server was linked
    return (
        draw(st.sampled_from(CONTEXTS)),
        b"SELECT 1\x00",
        received,
        acquired,
        sent,
        done,
        draw(st.sampled_from(TAGS)),
        draw(st.sampled_from([None, None, "42P01", "57014"])),
        draw(st.sampled_from([None, None, ("set",), ("prepare", "temp_table")])),
    )


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types, except that the compiled walk's int64
    arrays stand for the twin's lists of ints."""
    if isinstance(a, array) and a.typecode == "q" and type(b) is list:
        return _same(a.tolist(), b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(recs=st.lists(records(), min_size=1, max_size=40), offset=st.floats(-1e9, 1e10))
def test_compiled_columns_say_what_the_python_ones_say(recs: list[tuple], offset: float) -> None:
    tag_rows = {b"SELECT 1\x00": 1, b"UPDATE 7\x00": 7, b"BEGIN\x00": 0, 5: 5, 0: 0}
    assert _same(
        columns._compiled_group_columns(recs, tag_rows), columns.py_group_columns(recs, tag_rows)
    )
    assert _same(
        columns._compiled_event_columns(recs, tag_rows, offset),
        columns.py_event_columns(recs, tag_rows, offset),
    )


def test_a_tag_not_yet_known_goes_through_the_mappings_missing() -> None:
    class Rows(dict[Any, int]):
        def __missing__(self, tag: Any) -> int:
            self[tag] = len(tag)
            return len(tag)

    rec = (CONTEXTS[0], b"x", 0, 1, 1, 3000, b"ABCD", None, None)
    for group_columns in (columns._compiled_group_columns, columns.py_group_columns):
        rows = Rows()
        assert group_columns([rec, rec], rows)[8] == 8 and rows == {b"ABCD": 4}


@pytest.mark.parametrize("time", [2.5, -0.5, True, 2**40 + 0.5])
def test_a_time_that_is_not_an_exact_int_is_read_as_the_twin_reads_it(time: Any) -> None:
    """Floats are not truncated (the twin does the arithmetic); a bool is its int."""
    rec = (CONTEXTS[0], b"x", 10, time, time, 2**40 + 3, b"BEGIN\x00", None, None)
    tag_rows = {b"BEGIN\x00": 0}
    assert _same(
        columns.group_columns([rec, rec], tag_rows), columns.py_group_columns([rec, rec], tag_rows)
    )


def test_durations_beyond_64_bits_are_the_twins_to_work_out() -> None:
    """Times at the ends of int64, whose differences and sums would wrap in C."""
    low, high = -(2**63), 2**63 - 1
    recs = [
        (CONTEXTS[0], b"x", low, low, high, high, b"BEGIN\x00", None, None),
        (CONTEXTS[1], b"x", 0, high, high, high, b"BEGIN\x00", None, None),
    ]
    tag_rows = {b"BEGIN\x00": 0}
    got = columns.group_columns(recs, tag_rows)
    assert _same(got, columns.py_group_columns(recs, tag_rows))
    assert got[1] == [2**64 - 1, high] and got[12] == 2**64 - 1 + high
    assert _same(
        columns.event_columns(recs, tag_rows, 0.0), columns.py_event_columns(recs, tag_rows, 0.0)
    )


@pytest.mark.parametrize("bad", [("not", "a", "record"), ("ctx", b"x", 0, 0, 0, 0, 0, None, None)])
def test_a_record_that_is_not_one_is_refused_by_both(bad: tuple) -> None:
    for walk in (columns._compiled_group_columns, columns.py_group_columns):
        with pytest.raises((TypeError, ValueError, IndexError, KeyError)):
            walk([bad], {})
    for walk in (columns._compiled_event_columns, columns.py_event_columns):
        with pytest.raises((TypeError, ValueError, IndexError, KeyError)):
            walk([bad], {}, 0.0)


# Statement texts as the proxy records them (a Query body keeps its NUL),
# digits and all, some longer than the compiled walk's stack buffer.
text_st = st.one_of(
    st.binary(max_size=40),
    st.builds(
        lambda n, pad: b"SELECT abalance FROM t WHERE aid = %d;" % n + b" " * pad + b"\x00",
        st.integers(0, 10**9),
        st.sampled_from([0, 1, 600, 5000]),
    ),
)


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(text_st, min_size=1, max_size=30), known=st.integers(0, 5))
def test_chunk_variants_and_groups_say_what_the_python_ones_say(
    texts: list[bytes], known: int
) -> None:
    recs = [(CONTEXTS[0], text, 0, 0, 0, 0, 5, None, None) for text in texts]
    cache = {fingerprint.variant_key(text): f"v{i}" for i, text in enumerate(texts[:known])}
    compiled = columns._compiled_chunk_variants(recs, cache)
    assert compiled == columns.py_chunk_variants(recs, cache)
    assert compiled[1] == [fingerprint.variant_key(text) for text in texts]
    variants = compiled[2]
    groups = columns._compiled_group_records(variants, recs)
    assert groups == columns.py_group_records(variants, recs)
    assert list(groups) == list(dict.fromkeys(variants)) and sum(map(len, groups.values())) == len(
        recs
    )


def test_what_is_not_a_chunk_of_records_is_refused_by_both() -> None:
    not_bytes = [(CONTEXTS[0], "SELECT 1", 0, 0, 0, 0, 5, None, None)]
    for walk in (columns._compiled_chunk_variants, columns.py_chunk_variants):
        with pytest.raises(TypeError):
            walk(not_bytes, {})
    for group in (columns._compiled_group_records, columns.py_group_records):
        with pytest.raises(ValueError):
            group([1, 2], [()])
