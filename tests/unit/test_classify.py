"""Unit tests for scry.protocol.classify: statement text -> session-state effects.

A table of statements with their expected effects (the tricky ones included:
keywords inside literals, comments and dollar quotes, multi-statement texts,
in-text rollbacks), then properties of the fast path: it says "stateless"
for ordinary DML whatever the literals, and it is never wrong -- whenever the
parser finds an effect, the fast path did not claim the text was stateless.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scry.protocol.classify import (
    Effect,
    _classify_cached,
    classify,
    classify_bytes,
    is_stateless_fast,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pin(reason: str, key: str | None = None, replay: str | None = None, tx: bool = True) -> Effect:
    return Effect("pin", reason, key, replay, tx)  # type: ignore[arg-type]


def unpin(reason: str, key: str | None = None, tx: bool = True) -> Effect:
    return Effect("unpin", reason, key, None, tx)  # type: ignore[arg-type]


ADVISORY = pin("advisory_lock", tx=False)
UNLOCK_ONE = unpin("advisory_lock", "one", tx=False)

CASES: list[tuple[str, tuple[Effect, ...]]] = [
    # --- stateless -------------------------------------------------------
    ("SELECT 1", ()),
    ("SELECT abalance FROM pgbench_accounts WHERE aid = 12345;", ()),
    ("UPDATE t SET a = 1 WHERE b = 2", ()),
    ("INSERT INTO t VALUES (1, 'SET x = 1')", ()),
    ("DELETE FROM t", ()),
    ("BEGIN", ()),
    ("COMMIT", ()),
    ("ROLLBACK", ()),
    ("START TRANSACTION ISOLATION LEVEL SERIALIZABLE", ()),
    ("SAVEPOINT s", ()),
    ("CREATE TABLE t (a int)", ()),
    ("DROP INDEX i", ()),
    ("COPY t FROM STDIN", ()),
    ("DO $$BEGIN PERFORM 1; END$$", ()),
    ("CALL proc(1)", ()),
    ("EXPLAIN SELECT 1", ()),
    ("SHOW search_path", ()),
    ("PREPARE TRANSACTION 'gid'", ()),
    ("VACUUM t", ()),
    # keywords in literals, comments, dollar quotes, identifiers
    ("SELECT 'SET x = 1'", ()),
    ("/* SET */ SELECT 1", ()),
    ("-- SET search_path = x\nSELECT 1", ()),
    ("-- SELECT 1\nSET search_path = x", (pin("set", "search_path", "SET search_path = x"),)),
    ("SELECT $$pg_advisory_lock$$", ()),
    ("SELECT $tag$ ; SET x = 1 $tag$", ()),
    ("SELECT 'pg_advisory_lock(1)'", ()),
    ("SELECT 1 AS \"SET x = 1\"", ()),
    ("SELECT 'a;b'", ()),
    ("SELECT * FROM intoxicants", ()),
    ("SELECT current_setting('search_path')", ()),
    ("SELECT * FROM pg_settings", ()),
    # SET LOCAL / SET TRANSACTION / transaction-only GUCs: gone at transaction end
    ("SET LOCAL search_path = x", ()),
    ("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", ()),
    ("SET transaction_isolation = 'serializable'", ()),
    ("SET CONSTRAINTS ALL DEFERRED", ()),
    ("SELECT set_config('a.b', 'x', true)", ()),
    ("SELECT set_config('a.b', 'x', 'on')", ()),
    ("SELECT pg_advisory_xact_lock(1)", ()),
    ("SELECT pg_try_advisory_xact_lock_shared(1)", ()),
    ("DECLARE c CURSOR FOR SELECT 1", ()),
    ("CREATE TEMP TABLE t (a int) ON COMMIT DROP", ()),
    ("DISCARD PLANS", ()),
    ("DISCARD SEQUENCES", ()),
    # unparseable: the server rejects it too
    ("SELEC 1", ()),
    ("SELECT 'unterminated", ()),
    # --- SET -------------------------------------------------------------
    ("SET search_path = app, public", (pin("set", "search_path", "SET search_path = app, public"),)),
    ("set search_path to app", (pin("set", "search_path", "set search_path to app"),)),
    ("SET SESSION statement_timeout = 5", (pin("set", "statement_timeout", "SET SESSION statement_timeout = 5"),)),
    ('SET "MyApp.User" = 7', (pin("set", "myapp.user", 'SET "MyApp.User" = 7'),)),
    ("SET ROLE admin", (pin("set", "role", "SET ROLE admin"),)),
    ("SET SESSION AUTHORIZATION bob", (pin("set", "session_authorization", "SET SESSION AUTHORIZATION bob"),)),
    ("SET TIME ZONE 'UTC'", (pin("set", "timezone", "SET TIME ZONE 'UTC'"),)),
    ("SET a FROM CURRENT", (pin("set", "a"),)),
    (
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ ONLY",
        (
            pin("set", "default_transaction_isolation", "SET default_transaction_isolation TO 'serializable'"),
            pin("set", "default_transaction_read_only", "SET default_transaction_read_only TO 'on'"),
        ),
    ),
    ("  /* why */ SET a = 1 -- trailing\n", (pin("set", "a", "SET a = 1"),)),
    ("SET a = 1;", (pin("set", "a", "SET a = 1"),)),
    ("RESET search_path", (unpin("set", "search_path"),)),
    ("SET search_path TO DEFAULT", (unpin("set", "search_path"),)),
    ("SET TIME ZONE LOCAL", (unpin("set", "timezone"),)),
    ("RESET ROLE", (unpin("set", "role"),)),
    ("RESET ALL", (unpin("set"),)),
    # set_config
    (
        "SELECT set_config('app.user', '42', false)",
        (pin("set", "app.user", "SELECT pg_catalog.set_config('app.user', '42', false)"),),
    ),
    (
        "select pg_catalog.set_config('A.B', 'it''s', 'false'::boolean)",
        (pin("set", "a.b", "SELECT pg_catalog.set_config('A.B', 'it''s', false)"),),
    ),
    (
        "SELECT set_config('a.x', '1', false), set_config('a.y', '2', false)",
        (
            pin("set", "a.x", "SELECT pg_catalog.set_config('a.x', '1', false)"),
            pin("set", "a.y", "SELECT pg_catalog.set_config('a.y', '2', false)"),
        ),
    ),
    ("SELECT set_config('a.b', $1, false)", (pin("set", "a.b"),)),
    ("SELECT set_config($1, $2, false)", (pin("set", "set_config"),)),
    ("SELECT set_config('a.b', 'x', $1)", (pin("set", "a.b"),)),
    ("SELECT set_config('a.b', v, false) FROM t", (pin("set", "a.b"),)),
    ("SELECT 1 WHERE set_config(name, 'x', false) IS NOT NULL", (pin("set", "set_config"),)),
    ("UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'", (pin("set", "search_path"),)),
    ("UPDATE pg_catalog.pg_settings SET setting = 'x'", (pin("set", "set_config"),)),
    # --- PREPARE ---------------------------------------------------------
    (
        "PREPARE q (int) AS SELECT * FROM t WHERE a = $1",
        (pin("prepare", "q", "PREPARE q (int) AS SELECT * FROM t WHERE a = $1", tx=False),),
    ),
    ("DEALLOCATE q", (unpin("prepare", "q", tx=False),)),
    ("DEALLOCATE PREPARE q", (unpin("prepare", "q", tx=False),)),
    ("DEALLOCATE ALL", (unpin("prepare", None, tx=False),)),
    # --- temp objects ----------------------------------------------------
    ("CREATE TEMP TABLE t (a int)", (pin("temp_table", "t"),)),
    ("CREATE TEMPORARY TABLE IF NOT EXISTS T (a int)", (pin("temp_table", "t"),)),
    ('CREATE TEMP TABLE "Mixed" (a int)', (pin("temp_table", "Mixed"),)),
    ("CREATE TEMP TABLE t AS SELECT 1", (pin("temp_table", "t"),)),
    ("CREATE TEMP VIEW v AS SELECT 1", (pin("temp_table", "v"),)),
    ("CREATE TEMP SEQUENCE s", (pin("temp_table", "s"),)),
    ("SELECT * INTO TEMP t FROM x", (pin("temp_table", "t"),)),
    ("SELECT 1 INTO TEMPORARY t UNION SELECT 2", (pin("temp_table", "t"),)),
    ("CREATE TABLE pg_temp.x (a int)", (pin("temp_table", "x"),)),
    ("CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql AS 'SELECT 1'", (pin("temp_table", "f"),)),
    ("SELECT * INTO t2 FROM x", ()),
    ("EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1", (pin("temp_table", "t"),)),
    ("EXPLAIN CREATE TEMP TABLE t AS SELECT 1", ()),
    ("DROP TABLE a, public.b, pg_temp.c", (unpin("temp_table", "a"), unpin("temp_table", "c"))),
    ("DROP VIEW IF EXISTS v", (unpin("temp_table", "v"),)),
    ("DROP SEQUENCE s CASCADE", (unpin("temp_table", "s"),)),
    ("DISCARD TEMP", (unpin("temp_table"),)),
    # --- cursors ---------------------------------------------------------
    ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", (pin("cursor", "c"),)),
    ("DECLARE c BINARY NO SCROLL CURSOR WITH HOLD FOR SELECT 1", (pin("cursor", "c"),)),
    ("CLOSE c", (unpin("cursor", "c", tx=False),)),
    ("CLOSE ALL", (unpin("cursor", None, tx=False),)),
    # --- advisory locks --------------------------------------------------
    ("SELECT pg_advisory_lock(1)", (ADVISORY,)),
    ("select PG_ADVISORY_LOCK_SHARED(1, 2)", (ADVISORY,)),
    ("SELECT pg_try_advisory_lock(hashtext('job'))", (ADVISORY,)),
    ("SELECT pg_catalog.pg_try_advisory_lock_shared(1)", (ADVISORY,)),
    ("SELECT id FROM jobs WHERE pg_try_advisory_lock(id) LIMIT 1", (ADVISORY,)),
    ("WITH l AS (SELECT pg_advisory_lock(7)) SELECT * FROM l", (ADVISORY,)),
    ('SELECT U&"pg_advisory_lock"(1)', (ADVISORY,)),
    ("SELECT pg_advisory_unlock(1)", (UNLOCK_ONE,)),
    ("SELECT pg_advisory_unlock_shared(1)", (UNLOCK_ONE,)),
    ("SELECT pg_advisory_unlock_all()", (unpin("advisory_lock", tx=False),)),
    ("SELECT pg_advisory_unlock(1), pg_advisory_lock(2)", (UNLOCK_ONE, ADVISORY)),
    ("INSERT INTO t SELECT pg_advisory_lock(1)", (ADVISORY,)),
    # --- LISTEN, LOAD, DISCARD -------------------------------------------
    ("LISTEN ch", (pin("listen", "ch"),)),
    ('LISTEN "Ch"', (pin("listen", "Ch"),)),
    ("UNLISTEN ch", (unpin("listen", "ch"),)),
    ("UNLISTEN *", (unpin("listen"),)),
    ("LOAD 'auto_explain'", (pin("load", "auto_explain", tx=False),)),
    ("DISCARD ALL", (Effect("unpin_all", "session_other", None, None, False),)),
    # --- several statements in one text ----------------------------------
    ("SELECT 1; SET search_path = x", (pin("set", "search_path", "SET search_path = x"),)),
    ("SELECT 1;SET search_path = x;", (pin("set", "search_path", "SET search_path = x"),)),
    (
        "SET a = 1; SELECT 'é'; SET b = 'ü'",
        (pin("set", "a", "SET a = 1"), pin("set", "b", "SET b = 'ü'")),
    ),
    ("BEGIN; SET a = 1; ROLLBACK", ()),
    ("BEGIN; SET a = 1; COMMIT", (pin("set", "a", "SET a = 1"),)),
    ("SET a = 1; ROLLBACK", ()),
    ("BEGIN; SELECT pg_advisory_lock(1); PREPARE p AS SELECT 1; SET a = 1; ROLLBACK",
     (ADVISORY, pin("prepare", "p", "PREPARE p AS SELECT 1", tx=False))),
    ("SAVEPOINT s; SET a = 1; ROLLBACK TO SAVEPOINT s; SET b = 2", (pin("set", "b", "SET b = 2"),)),
    ("BEGIN; DROP TABLE t; ROLLBACK", ()),
    ("COMMIT; BEGIN; SET c = 3", (pin("set", "c", "SET c = 3"),)),
    # --- parser cannot, server might (version skew): pin conservatively -
    ("SELECT 1; SET foo = bar baz", (pin("session_other", "unparsed set", tx=False),)),
    ("FROBNICATE x; SELECT pg_advisory_lock(1) FROM", (pin("session_other", "unparsed pg_advisory_lock", tx=False),)),
    ("FROBNICATE x; SET LOCAL a = 1", ()),
]  # fmt: skip


@pytest.mark.parametrize(("sql", "expected"), CASES, ids=[c[0][:60] for c in CASES])
def test_classify(sql: str, expected: tuple[Effect, ...]) -> None:
    assert classify(sql) == expected
    assert classify_bytes(sql.encode() + b"\x00") == expected
    assert _classify_cached(sql) == expected  # the slow path alone agrees
    if is_stateless_fast(sql):
        assert expected == ()


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT abalance FROM pgbench_accounts WHERE aid = 12345;",
        "UPDATE pgbench_accounts SET abalance = abalance + -4000 WHERE aid = 1;",
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 2, 3, 4, now());",
        "  select 1",
        "BEGIN",
        "BEGIN;",
        "END;",
        "commit",
        "/* app=web */ SELECT 1",
        "-- hi\nSELECT 1",
        "SELECT 1 ;  \n",
        "WITH x AS (SELECT 1) SELECT * FROM x",
        "MERGE INTO t USING s ON t.a = s.a WHEN MATCHED THEN DELETE",
    ],
)
def test_fast_path_takes_the_common_case(sql: str) -> None:
    assert is_stateless_fast(sql)
    assert classify(sql) == ()


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1; SET x = 1",
        "SELECT 1; -- then\n SET x = 1",
        "SELECT pg_advisory_lock(1)",
        "SELECT set_config('a', 'b', false)",
        "SELECT 1 INTO TEMP t",
        'SELECT U&"\\0070g_advisory_lock"(1)',
        "/* /* nested */ SELECT 1 */ SET x = 1",
        "-- SELECT 1\nSET x = 1",
        "--SELECT 1\r SET x = 1",
        "SET x = 1",
        "EXPLAIN ANALYZE SELECT 1",
        "UPDATE pg_settings SET setting = '1' WHERE name = 'a'",
        "selectx",
        "(SELECT 1)",
    ],
)
def test_fast_path_declines_what_it_cannot_prove(sql: str) -> None:
    assert not is_stateless_fast(sql)


def test_nested_comment_does_not_hide_a_set() -> None:
    # PostgreSQL nests block comments: the SELECT is inside the comment.
    assert classify("/* /* nested */ SELECT 1 */ SET x = 1") == (pin("set", "x", "SET x = 1"),)


def test_unicode_escape_identifier_is_seen_by_the_parser() -> None:
    assert classify('SELECT U&"\\0070g_advisory_lock"(1)') == (ADVISORY,)


def test_results_are_cached() -> None:
    sql = "SET application_name = 'cache-test'"
    first = classify(sql)
    assert classify(sql) is first


def test_non_utf8_body_still_classifies() -> None:
    assert classify_bytes(b"SET client_encoding = 'latin1'; SELECT '\xe9'\x00") == (
        pin("set", "client_encoding", "SET client_encoding = 'latin1'"),
    )


# --- properties ------------------------------------------------------------

LITERALS = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        max_size=20,
    ).map(lambda s: "'" + s.replace("'", "''") + "'"),
)
RISKY_WORDS = ("advisory", "set_config", "pg_settings", "u&", "into", ";")
SAFE_TEMPLATES = [
    "SELECT abalance FROM pgbench_accounts WHERE aid = {}",
    "UPDATE pgbench_accounts SET abalance = abalance + {} WHERE aid = 1",
    "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 2, 3, {}, now())",
    "DELETE FROM t WHERE a = {}",
    "SELECT * FROM t WHERE a IN ({}, {}) ORDER BY b LIMIT 10",
    "WITH x AS (SELECT {}) SELECT * FROM x",
    "VALUES ({})",
]


@FUZZ
@given(
    template=st.sampled_from(SAFE_TEMPLATES),
    literals=st.lists(LITERALS, min_size=2, max_size=2),
    semicolon=st.sampled_from(["", ";", " ;", ";\n", "; "]),
    lead=st.sampled_from(["", " ", "\n", "/* tag */ ", "-- c\n"]),
)
def test_fast_path_says_stateless_for_plain_dml(
    template: str, literals: list[str], semicolon: str, lead: str
) -> None:
    # A literal that mentions a risky word rightly sends the text to the slow
    # path (a false alarm costs time only); everything else must be fast.
    assume(not any(word in "".join(literals).lower() for word in RISKY_WORDS))
    sql = lead + template.format(*literals) + semicolon
    assert is_stateless_fast(sql), sql
    assert classify(sql) == ()


# Fragments that, glued together at random, make texts mixing stateless and
# stateful statements with literals, comments and quotes that mention keywords.
FRAGMENTS = [
    "SELECT 1", "SELECT", " ", "\n", ";", "'", "$$", "$q$", '"', "/*", "*/", "--",
    "SET search_path = x", "SET LOCAL a = 1", "SET", "PREPARE p AS SELECT 1", "DEALLOCATE p",
    "CREATE TEMP TABLE t (a int)", "TEMP", "INTO", "INTO TEMP t", "pg_advisory_lock(1)",
    "pg_advisory_xact_lock(1)", "set_config('a', 'b', false)", "DECLARE c CURSOR WITH HOLD FOR",
    "LISTEN ch", "LOAD 'x'", "DISCARD ALL", "BEGIN", "COMMIT", "ROLLBACK", "WITH x AS (", ")",
    "FROM t", "WHERE a = 1", "U&\"\\0070g_advisory_lock\"(1)", "INSERT INTO t", "VALUES (1)",
    "EXPLAIN ANALYZE", "CREATE TABLE pg_temp.x (a int)", "x", ",", "(", "E'\\''",
]  # fmt: skip


@FUZZ
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12))
def test_fast_path_is_never_wrong(parts: list[str]) -> None:
    sql = " ".join(parts)
    if is_stateless_fast(sql):
        assert _classify_cached(sql) == (), sql


@FUZZ
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12))
def test_fast_path_is_never_wrong_without_spaces(parts: list[str]) -> None:
    sql = "".join(parts)
    if is_stateless_fast(sql):
        assert _classify_cached(sql) == (), sql


LEAD_PIECES = [
    "--",
    "-- SELECT 1",
    "/*",
    "*/",
    "/* SELECT */",
    "\n",
    "\r",
    " ",
    "\t",
    "SELECT 1",
    "x",
]


@FUZZ
@given(
    lead=st.lists(st.sampled_from(LEAD_PIECES), max_size=6),
    body=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6),
)
def test_fast_path_is_never_fooled_by_leading_comments(lead: list[str], body: list[str]) -> None:
    sql = "".join(lead) + " ".join(body)
    if is_stateless_fast(sql):
        assert _classify_cached(sql) == (), sql


# --- the compiled relay's twin of the fast path (scry/_relay.pyx) -------------

try:
    from scry._relay import stateless_text
except ImportError:  # the extension was not built: the relay calls classify itself
    stateless_text = None
compiled = pytest.mark.skipif(stateless_text is None, reason="the extension was not built")
# Bytes that could fool a bytes-level scan: case, non-ASCII letters whose
# lower() is ASCII-like, NUL, and the white space that may follow a ";".
BYTE_PIECES = [*FRAGMENTS, "İNTO", "ſet_config", "Ａdvisory", "select", "SELECT ", "\x00", "\t",
               "\x0b", "\x0c", "; ", ";\x00", "u", "&", "é", "insert", "merge into t"]  # fmt: skip


@compiled
@FUZZ
@given(st.lists(st.sampled_from(BYTE_PIECES), min_size=1, max_size=12), st.booleans())
def test_compiled_fast_path_is_never_more_sure_than_the_python_one(
    parts: list[str], spaced: bool
) -> None:
    body = (" " if spaced else "").join(parts).encode() + b"\x00"  # as a Query body
    if stateless_text(body):
        assert is_stateless_fast(body.decode()), body


@compiled
@FUZZ
@given(
    template=st.sampled_from(SAFE_TEMPLATES),
    literals=st.lists(LITERALS, min_size=2, max_size=2),
    semicolon=st.sampled_from(["", ";", " ;", ";\n", "; "]),
)
def test_compiled_fast_path_takes_plain_dml(
    template: str, literals: list[str], semicolon: str
) -> None:
    assume(not any(word in "".join(literals).lower() for word in RISKY_WORDS))
    body = (template.format(*literals) + semicolon).encode() + b"\x00"
    assert stateless_text(body), body


@compiled
@pytest.mark.parametrize(
    "sql",
    ["SET x = 1", "SELECT pg_advisory_lock(1)", "SELECT 1 INTO TEMP t", "SELECT 1; SET x = 1",
     'SELECT U&"x"', "SELECT set_config('a', 'b', false)", "selectx 1", "",
     "UPDATE pg_settings SET setting = '1'", "INSERT INTO t SELECT 1; SELECT 1 INTO u"],
)  # fmt: skip
def test_compiled_fast_path_leaves_the_rest_to_python(sql: str) -> None:
    assert not stateless_text(sql.encode() + b"\x00")
