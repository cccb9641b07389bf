"""standard_text held to PostgreSQL: a text run with
standard_conforming_strings=off gives what its rewrite gives with it on."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry.devcluster import DevCluster
from scry.protocol.string_escapes import standard_text

# Pieces that are valid inside a literal read with the setting off; several
# of them end the literal early, or open a new one, when read with it on.
_INSIDE = st.sampled_from(
    [b"a", b" ", b"\\'", b"''", b"\\\\", b"\\n", b'"', b"$$", b"--", b"/*", b"*/",
     b"\n", b";", b"\\x41", b"\\", b"e", b"'"]
)  # fmt: skip
_BODY = st.lists(_INSIDE, max_size=8).map(b"".join)


def _literal(prefix: bytes) -> st.SearchStrategy[bytes]:
    return _BODY.map(lambda body: prefix + b"'" + body + b"'")


_ITEM = st.one_of(
    _literal(b""),
    _literal(b"E"),
    _literal(b"N"),
    _literal(b"text "),
    _literal(b"text"),  # a word right before the quote
    _literal(b"U&"),  # refused with the setting off, either way
    st.tuples(_literal(b""), _literal(b"")).map(lambda p: p[0] + b"\n" + p[1]),
    st.tuples(_literal(b""), _literal(b"")).map(lambda p: p[0] + b" -- c\\'\n " + p[1]),
    _BODY.map(lambda b: b"$q$" + b.replace(b"$q$", b"") + b"$q$"),
    st.sampled_from([b"/* a ' /* \\' */ b */ 'z'", b"-- x ' \\\n'y'", b'"a\\\'b"', b"X'1F'"]),
)
_TEXT = st.lists(_ITEM, min_size=1, max_size=4).map(lambda items: b"SELECT " + b" || ".join(items))


@pytest.fixture(scope="module")
def readers(pg: DevCluster) -> Iterator[tuple[psycopg.Connection, psycopg.Connection]]:
    dsn = pg.dsn(user="postgres")
    with (
        psycopg.connect(
            dsn,
            autocommit=True,
            options="-c standard_conforming_strings=off -c escape_string_warning=off",
        ) as off,
        psycopg.connect(dsn, autocommit=True) as on,
    ):
        yield off, on


def _outcome(conn: psycopg.Connection, text: bytes) -> tuple[str, object]:
    result = conn.pgconn.exec_(text)
    if result.status == psycopg.pq.ExecStatus.TUPLES_OK:
        return "rows", [result.get_value(0, c) for c in range(result.nfields)]
    return "error", (result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) or b"").decode()


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_TEXT)
def test_rewrite_reads_as_postgresql_reads_the_original(
    readers: tuple[psycopg.Connection, psycopg.Connection], text: bytes
) -> None:
    off, on = readers
    expected = _outcome(off, text)
    if expected == ("error", "0A000"):
        # U&'' is refused with the setting off ("unsafe use of string constant
        # with Unicode escapes"): it never runs, however it is read.
        assert b"U&" in text
        return
    rewritten = standard_text(text)
    assert _outcome(on, rewritten) == expected
    assert standard_text(rewritten) == rewritten  # the drain may rewrite a chunk twice


def test_the_examples_are_mostly_valid_sql(
    readers: tuple[psycopg.Connection, psycopg.Connection],
) -> None:
    """The property above proves little if both sides just fail to parse.
    (The same 200 texts every run: ``.example()`` draws from a small batch
    that differs from run to run, and its share of valid SQL with it.)"""
    off, _ = readers
    valid: list[bool] = []

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(text=_TEXT)
    def run(text: bytes) -> None:
        valid.append(_outcome(off, text)[0] == "rows")

    run()
    assert len(valid) == 200 and sum(valid) >= 100, sum(valid)
