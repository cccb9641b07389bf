"""No raw literal survives anonymization, normalization or fingerprinting."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry.observe.anonymize import Anonymizer, derive_key
from scry.observe.fingerprint import Fingerprinter

ANON = Anonymizer("canary-test-key")
FP = Fingerprinter(ANON)

canary_core = st.text(alphabet="ABCDEFGHJKMNPQRSTUVWXYZ", min_size=6, max_size=12).map(
    lambda s: "Cnry" + s
)
junk = st.lists(
    st.sampled_from(list("ab '\\\"$-/*\n\t;,()éß漢") + ["''", "--", "/*", "*/", "$$"]),
    max_size=8,
).map("".join)

STRING_FORMS = {
    "plain": lambda c: "'" + c.replace("'", "''") + "'",
    "escape": lambda c: "E'" + c.replace("\\", "\\\\").replace("'", "\\'") + "'",
    "dollar": lambda c: "$$" + c + "$$",
    "tagged": lambda c: "$body$" + c + "$body$",
    "national": lambda c: "N'" + c.replace("'", "''") + "'",
    "typed": lambda c: "text '" + c.replace("'", "''") + "'",
}
SHAPES = [
    "SELECT * FROM t WHERE c = {lit}",
    "SELECT * FROM t WHERE c IN ({lit}, {lit}, 'other')",
    "INSERT INTO t (a, b) VALUES ({lit}, 1)",
    "UPDATE t SET a = {lit} WHERE id = 1",
    "SET application_name = {lit}",
    "SELECT {lit}::text AS x",
    "CREATE TABLE x (a text DEFAULT {lit})",
    "SELECT f({lit}) FROM t -- trailing",
    "SELEC broken {lit} FROM",
    "SELECT * FROM t WHERE c = {lit} /* unterminated",
]


def _leaks(text: str, *canaries: str) -> list[str]:
    return [c for c in canaries if c in text]


def _check(sql: str, *canaries: str) -> None:
    anonymized = ANON.anonymize_sql(sql)
    shape = FP.fingerprint(sql)
    outputs = {
        "anonymized": anonymized,
        "normalized": shape.normalized,
        "fingerprint": shape.fingerprint,
        "tables": " ".join(shape.tables),
    }
    for name, text in outputs.items():
        assert not _leaks(text, *canaries), f"{name} leaks a literal of {sql!r}: {text!r}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    core=canary_core,
    before=junk,
    after=junk,
    form=st.sampled_from(sorted(STRING_FORMS)),
    shape=st.sampled_from(SHAPES),
)
def test_string_canaries_never_survive(
    core: str, before: str, after: str, form: str, shape: str
) -> None:
    content = before + core + after
    if form in ("dollar", "tagged"):
        content = content.replace("$", "")  # a "$" could close the quote early
    sql = shape.replace("{lit}", STRING_FORMS[form](content))
    _check(sql, core)


@settings(max_examples=300, deadline=None)
@given(
    number=st.integers(min_value=10_000_000, max_value=10**15),
    fraction=st.integers(min_value=0, max_value=999),
    form=st.sampled_from(["{n}", "-{n}", "{n}.{f}", "-{n}.{f}e3", "{n}::bigint", "+{n}"]),
    shape=st.sampled_from(
        SHAPES
        + [
            "SELECT * FROM t LIMIT {lit} OFFSET {lit}",
            "SELECT ARRAY[{lit}, {lit}]",
            "SELECT x - {lit} FROM t",
        ]
    ),
)
def test_number_canaries_never_survive(number: int, fraction: int, form: str, shape: str) -> None:
    literal = form.format(n=number, f=fraction)
    sql = shape.replace("{lit}", literal)
    _check(sql, str(number))


@settings(max_examples=100, deadline=None)
@given(core=canary_core, number=st.integers(min_value=10_000_000, max_value=10**12))
def test_comments_with_literals_are_dropped(core: str, number: int) -> None:
    sql = f"/* user={core} */ SELECT * FROM t -- id {number}\n WHERE a = 1 /* {number} /* nested */ */"
    _check(sql, core, str(number))


def test_tokens_are_keyed_deterministic_and_short() -> None:
    a = ANON.anonymize_sql("SELECT * FROM t WHERE name = 'alice' AND n = 12345678")
    b = ANON.anonymize_sql("select * from t where name = 'alice' and n = 12345678")
    other = Anonymizer("another-key").anonymize_sql("SELECT * FROM t WHERE name = 'alice'")
    token = re.search(r"'([a-z2-7]{6})…'", a)
    assert token and token.group(0) in b
    assert token.group(0) not in other
    assert re.search(r"n = #[a-z2-7]{6}…", a)
    assert "FROM t WHERE name" in a  # structure, identifiers and keywords stay


def test_key_derivation() -> None:
    assert derive_key("s") == derive_key("s") != derive_key("t")
    assert len(derive_key("s")) == 32
    assert derive_key(None) != derive_key(None)  # random per process when unset
    assert Anonymizer(None).key_is_random and not Anonymizer("k").key_is_random
