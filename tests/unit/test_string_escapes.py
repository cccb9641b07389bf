"""standard_text: texts of standard_conforming_strings=off sessions, written
for readers that assume it is on (tests/integration/test_string_escapes_pg.py
holds it to PostgreSQL's own reading)."""

from __future__ import annotations

import pytest

from scry.protocol.string_escapes import standard_text


@pytest.mark.parametrize(
    ("sent", "written"),
    [
        # Plain literals with a backslash become E'' literals.
        (rb"SELECT 'x\' AS secret --'", rb"SELECT E'x\' AS secret --'"),
        (rb"INSERT INTO t VALUES ('it\'s'); SET search_path = x",
         rb"INSERT INTO t VALUES (E'it\'s'); SET search_path = x"),
        # After a word, the E must not join it ("abcE" would be a name).
        (rb"SELECT date'2020\'' x", rb"SELECT date E'2020\'' x"),
        (rb"SELECT N'a\'b'", rb"SELECT nchar E'a\'b'"),
        # A continuation is one literal: only its first part takes the E.
        (b"SELECT 'a\\''\n'b'", b"SELECT E'a\\''\n'b'"),
        (b"SELECT 'a' -- note\n  'b\\'c'", b"SELECT E'a' -- note\n  'b\\'c'"),
        # Unterminated: to the end, still prefixed.
        (rb"SELECT 'a\'", rb"SELECT E'a\'"),
    ],
)  # fmt: skip
def test_plain_literals_become_escape_literals(sent: bytes, written: bytes) -> None:
    assert standard_text(sent) == written


@pytest.mark.parametrize(
    "text",
    [
        rb"SELECT E'x\' AS y'",  # already E''
        rb"SELECT $$a\'$$, $q$ 'b\' $q$",  # dollar quotes take no escapes
        rb"SELECT 1 -- it's a \ comment",
        rb"SELECT 1 /* it's /* nested \ */ still ' */ ",
        b'SELECT "it\\\'s" FROM t',  # a quoted name
        rb"SELECT X'1F', B'10\'",  # bit strings: no escapes (PostgreSQL rejects the \ anyway)
        rb"SELECT a$b$c, 1 WHERE x ~ E'\\d'",
        b"SELECT 'no backslash'",
        b"SELECT 1 \\g",
    ],
)
def test_texts_without_plain_escapes_are_unchanged(text: bytes) -> None:
    assert standard_text(text) == text


def test_words_ending_in_a_prefix_letter_are_words() -> None:
    # "some" then a plain literal; "e" is not an E'' prefix here.
    assert standard_text(rb"SELECT some'a\'b'") == rb"SELECT some E'a\'b'"
    assert standard_text(rb"SELECT xe'a\'b'") == rb"SELECT xe E'a\'b'"
