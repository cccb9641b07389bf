"""Fingerprints: equal for the same statement, different for different ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.observe.anonymize import Anonymizer
from scry.observe.fingerprint import (
    DIGITS_TO_ZERO,
    Fingerprinter,
    lookup_values,
    value_key,
    variant_key,
)
from scry.observe.lexer import canonical, render, shape_of, tables_by_lexer


@pytest.fixture
def fp() -> Fingerprinter:
    return Fingerprinter(Anonymizer("test-key"))


SAME = [
    # literals
    [
        "SELECT * FROM t WHERE id = 1",
        "SELECT * FROM t WHERE id = 42",
        "SELECT * FROM t WHERE id = -7",
    ],
    [
        "SELECT * FROM t WHERE name = 'a'",
        "SELECT * FROM t WHERE name = 'it''s'",
        "SELECT * FROM t WHERE name = E'x\\'y'",
        "SELECT * FROM t WHERE name = $$dollar$$",
        "SELECT * FROM t WHERE name = $tag$x$tag$",
        "SELECT * FROM t WHERE name = $1",
    ],
    # IN-list length
    [
        "SELECT a FROM t WHERE id IN (1)",
        "SELECT a FROM t WHERE id IN (1, 2, 3)",
        "SELECT a FROM t WHERE id IN (4,5,6,7,8,9)",
        "SELECT a FROM t WHERE id IN ($1, $2)",
    ],
    # whitespace, comments, keyword casing, trailing semicolon
    [
        "SELECT a FROM t WHERE x = 1",
        "select   a\n\tfrom t where x=2;",
        "/* app: 42 */ SELECT a FROM t -- why 7\n WHERE x = 3",
        "SeLeCt A FROM T WHERE X = 4",
    ],
    [
        "UPDATE pgbench_accounts SET abalance = abalance + 17 WHERE aid = 99",
        "UPDATE pgbench_accounts SET abalance = abalance + -4523 WHERE aid = 1234;",
    ],
    ["INSERT INTO h (a, b) VALUES (1, 'x')", "INSERT INTO h (a, b) VALUES (2, 'y')"],
]
DIFFERENT = [
    "SELECT * FROM t WHERE id = 1",
    "SELECT * FROM u WHERE id = 1",
    "SELECT * FROM t WHERE other = 1",
    "SELECT id FROM t WHERE id = 1",
    "SELECT * FROM t WHERE id = 1 AND x = 2",
    "SELECT * FROM t WHERE id > 1",
    'SELECT * FROM "T" WHERE id = 1',
    "DELETE FROM t WHERE id = 1",
    "SELECT * FROM t WHERE id IN (SELECT id FROM u)",
]


@pytest.mark.parametrize("group", SAME, ids=[g[0][:30] for g in SAME])
def test_equal_fingerprints(fp: Fingerprinter, group: list[str]) -> None:
    ids = {fp.fingerprint(q).fingerprint for q in group}
    assert len(ids) == 1, [(q, fp.fingerprint(q).fingerprint) for q in group]


def test_different_statements_differ(fp: Fingerprinter) -> None:
    ids = [fp.fingerprint(q).fingerprint for q in DIFFERENT]
    assert len(set(ids)) == len(ids)


def test_fingerprint_is_16_hex_and_stable_across_instances() -> None:
    a = Fingerprinter(Anonymizer("one")).fingerprint("SELECT 1 FROM t WHERE id = 5")
    b = Fingerprinter(None).fingerprint("select 1 from t where id = 9")
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 16 and int(a.fingerprint, 16) >= 0


def test_normalized_text_and_tables(fp: Fingerprinter) -> None:
    shape = fp.fingerprint("SELECT abalance FROM pgbench_accounts WHERE aid = 4242;")
    assert shape.normalized == "SELECT abalance FROM pgbench_accounts WHERE aid = $1;"
    assert shape.tables == ("pgbench_accounts",)
    assert shape.parsed
    shape = fp.fingerprint("WITH c AS (SELECT 1) SELECT * FROM c JOIN s.u ON c.x = u.y")
    assert shape.tables == ("s.u",)


def test_unparsable_sql_gets_a_stable_fingerprint(fp: Fingerprinter) -> None:
    a = fp.fingerprint("SELEC broken FROM t WHERE x = 'secret' AND y = 12")
    b = fp.fingerprint("SELEC  broken FROM t WHERE x = 'other' AND y = 13")
    c = fp.fingerprint("SELEC broken FROM u WHERE x = 'other' AND y = 13")
    assert not a.parsed
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert "secret" not in a.normalized and "12" not in a.normalized
    assert a.normalized == "SELEC broken FROM t WHERE x = ..."
    assert a.tables == ("t",)
    assert Fingerprinter(None).fingerprint(
        "SELEC broken FROM t WHERE x = 1 AND y = 2"
    ).fingerprint == (a.fingerprint)


def test_cache_levels(fp: Fingerprinter) -> None:
    for i in range(100):
        fp.fingerprint(f"SELECT * FROM t WHERE id = {i}")
    assert fp.parses == 1
    fp.fingerprint("SELECT * FROM t WHERE id = $1")
    fp.fingerprint("SELECT * FROM t WHERE id = $1")
    assert fp.parses == 1  # $1 shares the shape; the literal-free text is then cached
    assert b"SELECT * FROM t WHERE id = $1" in fp._texts
    assert b"SELECT * FROM t WHERE id = 5" not in fp._texts  # texts with values are not kept


def test_shape_of_fast_and_full_paths_agree_on_literals() -> None:
    key, literals, collapsed = shape_of(
        b"SELECT a FROM t1 WHERE x = 10 AND y IN (1, 2) AND t1.c2 = 'q'"
    )
    assert literals == [b"10", b"1", b"2", b"'q'"]
    assert collapsed and b"t1" in key and b"c2" in key
    key2, literals2, _ = shape_of(b'SELECT a FROM "t1" WHERE x = 10 -- c 5\n AND y = $$z$$')
    assert literals2 == ["10", "$$z$$"]
    assert "5" not in key2


def test_lexer_pieces() -> None:
    assert canonical('SELECT A, "B" FROM t WHERE x IN (1, 2) -- 9\n;') == (
        'select a , "B" from t where x in ( ? )'
    )
    assert render("SELECT f(x), y::int FROM a.b WHERE c IN (1, 2, 3)", None) == (
        "SELECT f(x), y::int FROM a.b WHERE c IN ($1, ...)"
    )
    assert tables_by_lexer('SELEC x FROM a.b JOIN "Q" ON true') == ("a.b", "Q")


def test_lookup_values(fp: Fingerprinter) -> None:
    text = b"SELECT abalance FROM pgbench_accounts WHERE aid = 4242"
    shape, literals, collapsed = fp.lookup(text)
    assert lookup_values(shape, text, literals, collapsed) == [("pgbench_accounts.aid", b"4242")]
    text = b"SELECT * FROM users u WHERE u.id IN (1, 2) AND u.name = 'bob' AND u.age > 3"
    shape, literals, collapsed = fp.lookup(text)
    assert lookup_values(shape, text, literals, collapsed) == [
        ("users.id", b"1"),
        ("users.id", b"2"),
        ("users.name", b"'bob'"),
    ]
    text = b"SELECT * FROM t WHERE id = $1"
    shape, literals, collapsed = fp.lookup(text)
    assert lookup_values(shape, text, literals, collapsed) == []  # no bind values here


VARIANT_TEXTS = [
    b"SELECT abalance FROM pgbench_accounts WHERE aid = 4242;\x00",
    b"SELECT abalance FROM pgbench_accounts WHERE aid = 9999;\x00",  # 4242's variant key
    b"SELECT abalance FROM pgbench_accounts WHERE aid = 17;\x00",
    b"SELECT abalance FROM pgbench_accounts WHERE aid = 17;",  # extended protocol: no NUL
    b"SELECT * FROM t1 WHERE id = 5",
    b"SELECT * FROM t2 WHERE id = 7",  # t1's variant key, another table
    b"SELECT * FROM t1 WHERE id = 8",
    b"SELECT * FROM t WHERE name = 'ab1' AND id IN (1, 2, 3)",
    b"SELECT * FROM t WHERE name = 'ab2' AND id IN (4, 5, 6)",
    b"SELECT * FROM t WHERE name = 'it''s' AND id = 12",
    b"SELECT * FROM t WHERE id = $1",
    b"SELECT * FROM t WHERE id = 5 -- comment 7",
    b'SELECT * FROM "t1" WHERE id = 5',
    b"UPDATE pgbench_accounts SET abalance = abalance + -4321 WHERE aid = 77;\x00",
    b"SELECT 0x1F, 1.5e3, .5 FROM t WHERE id = 00",
    b"SELECT o.id FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.id = 31",
    b"SELEC broken FROM t WHERE x = 'secret' AND y = 12",
]


def _drain_view(fp: Fingerprinter, text: bytes) -> tuple[str, list[bytes]]:
    """What the pipeline's drain gets for one text: fingerprint, hot value keys."""
    variant = fp.variants.get(variant_key(text))
    keys: tuple[bytes, ...] = ()
    if variant is None or not variant.matches(text):
        variant, keys = fp.resolve(text)
    spanned = [prefix + text[start:end] for prefix, start, end in variant.spans]
    return variant.shape.fingerprint, sorted({*keys, *spanned})


def test_variants_agree_with_lookup(fp: Fingerprinter) -> None:
    reference = Fingerprinter(Anonymizer("test-key"))
    for _ in range(2):  # the second round is served by the variant cache
        for text in VARIANT_TEXTS:
            raw = text[:-1] if text.endswith(b"\x00") else text
            shape, literals, collapsed = reference.lookup(raw)
            expected = sorted(
                value_key(column, literal)
                for column, literal in lookup_values(shape, raw, literals, collapsed)
            )
            assert _drain_view(fp, text) == (shape.fingerprint, expected), text
    assert fp.variants  # pgbench-like texts were kept
    t1 = fp.fingerprint("SELECT * FROM t1 WHERE id = 1").fingerprint
    assert _drain_view(fp, b"SELECT * FROM t2 WHERE id = 9")[0] != t1


def test_variant_spans_slice_values(fp: Fingerprinter) -> None:
    text = b"SELECT * FROM t WHERE name = 'ab1' AND id = 12;\x00"
    variant, keys = fp.resolve(text)
    assert keys == ()
    other = b"SELECT * FROM t WHERE name = 'xy9' AND id = 34;\x00"
    keys = [prefix + t[start:end] for t in (text, other) for prefix, start, end in variant.spans]
    assert sorted(keys) == sorted([b"t.name\0ab1", b"t.id\x0012", b"t.name\0xy9", b"t.id\x0034"])


def test_variant_cache_keeps_no_value(fp: Fingerprinter) -> None:
    for text in (b"SELECT * FROM t WHERE name = 'Alice' AND id = 4242", b"SELECT 31337"):
        fp.resolve(text)
    assert fp.variants and not any(
        isinstance(key, bytes) and (b"Alice" in key or b"4242" in key or b"31337" in key)
        for key in fp.variants
    )


def test_variant_cache_is_bounded() -> None:
    fp = Fingerprinter(None, max_variants=5)
    for i in range(40):
        fp.resolve(f"SELECT * FROM t WHERE name = 'n{i}'".encode())
    assert 0 < len(fp.variants) <= 5


# --------------------------------------------------------------------------- #
# The drain's caches never merge what PostgreSQL's fingerprint keeps apart
# --------------------------------------------------------------------------- #

_TABLES = ("t", "t1", "t2", "users", "orders2")
_COLUMNS = ("id", "c1", "c2", "name", "x")


def _literal() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(min_value=-(10**12), max_value=10**12).map(str),
        st.decimals(min_value=-1000, max_value=1000, places=2).map(str),
        st.text("ab1'9 ", max_size=6).map(lambda s: "'" + s.replace("'", "''") + "'"),
        st.sampled_from(["$1", "$2", "NULL", "true"]),
    )


@st.composite
def _query(draw: st.DrawFn) -> str:
    table = draw(st.sampled_from(_TABLES))
    column = draw(st.sampled_from(_COLUMNS))
    kind = draw(st.sampled_from(["eq", "in", "two", "update", "cmp", "arith"]))
    lit = draw(_literal())
    if kind == "eq":
        where = f"{column} = {lit}"
    elif kind == "in":
        items = draw(st.lists(_literal(), min_size=1, max_size=4))
        where = f"{column} IN ({', '.join(items)})"
    elif kind == "two":
        other = draw(st.sampled_from(_COLUMNS))
        where = f"{column} = {lit} AND {other} = {draw(_literal())}"
    elif kind == "cmp":
        where = f"{column} {draw(st.sampled_from(['<', '>=', '<>']))} {lit}"
    elif kind == "arith":
        op = draw(st.sampled_from(["+", "-", "*"]))
        where = f"{column} {op} {draw(st.integers(0, 99))} = {lit}"
    else:
        return f"UPDATE {table} SET {column} = {lit} WHERE id = {draw(_literal())}"
    select = draw(st.sampled_from(["*", column, f"{column}, id", "count(*)"]))
    text = f"SELECT {select} FROM {table} WHERE {where}"
    if draw(st.booleans()):
        text = text.lower()
    if draw(st.booleans()):
        text = text.replace(" ", draw(st.sampled_from(["  ", "\n", " \t"])))
    if draw(st.booleans()):
        text = f"/* app {draw(st.integers(0, 9))} */ " + text
    return text + draw(st.sampled_from(["", ";", " ;"]))


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(_query(), min_size=2, max_size=12))
def test_drain_fingerprints_agree_with_postgres(texts: list[str]) -> None:
    """Through the drain's own path (variant cache, shape cache, pglast for new
    shapes), twice so the second round comes from the caches: two texts share
    a scry fingerprint only when PostgreSQL's fingerprint says they are the
    same statement. (Not the converse: PostgreSQL also merges ``x IN (1)``
    with ``x = 1``, scry keeps them apart.)"""
    import pglast

    from scry.config import ObservabilityConfig
    from scry.observe.pipeline import Observatory
    from scry.observe.record import ClientContext

    obs = Observatory(ObservabilityConfig(anonymize_key="k"))
    tail = obs.subscribe(maxsize=1_000)
    ctx = ClientContext("c", "d", "u", "a")
    for _ in range(2):
        for text in texts:
            obs.record((ctx, text.encode() + b"\0", 0, 0, 0, 1_000, 1, None, None))
        obs.drain()
    ours = [tail.get_nowait()["fingerprint"] for _ in range(2 * len(texts))]
    assert ours[: len(texts)] == ours[len(texts) :]
    theirs = [pglast.parser.fingerprint(text) for text in texts]
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            if ours[i] == ours[j]:
                assert theirs[i] == theirs[j], (texts[i], texts[j])


@pytest.mark.parametrize(
    "text",
    [
        "INSERT INTO people (name, note) VALUES ('O'Brien', 'canary note')",  # unescaped '
        "SELECT \"name FROM t WHERE ssn = 'canary'",  # unterminated quoted identifier
        "UPDATE t SET a = 'it's canary' WHERE id = 1",
        "SELEC canary_word",  # no value at all: shown whole
    ],
)
def test_a_refused_statement_is_shown_only_up_to_its_first_value(
    fp: Fingerprinter, text: str
) -> None:
    shape = fp.fingerprint(text)
    assert not shape.parsed
    if "'" in text or '"' in text:
        assert "canary" not in shape.normalized and shape.normalized.endswith(" ...")
        assert not any("canary" in table for table in shape.tables)
    else:
        assert shape.normalized == "SELEC canary_word"


def test_cached_shape_never_parses(fp: Fingerprinter) -> None:
    text = b"SELECT * FROM t WHERE name = 'x' AND id = 12\x00"
    assert fp.cached_shape(text) is None and fp.parses == 0
    variant, _ = fp.resolve(text)
    same = b"SELECT * FROM t WHERE name = 'x' AND id = 98\x00"
    assert fp.cached_shape(same) is variant.shape and fp.parses == 1
    assert fp.cached_shape(b"SELECT * FROM t WHERE name = 'y' AND id = 98\x00") is None
    # The cache also answers by digits-zeroed text (what readers used as the key).
    assert fp.variants.get(same.translate(DIGITS_TO_ZERO)) is variant
    assert fp.variants.lookup(variant_key(text)) is variant
