"""Unit tests for the PgBouncer userlist.txt parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from scry.config import ConfigError
from scry.userlist import load_userlist, parse_userlist, secret_kind

MD5 = "md5" + "0123456789abcdef" * 2
SCRAM = (
    "SCRAM-SHA-256$4096:c2FsdHNhbHQ=$"
    "c3RvcmVka2V5c3RvcmVka2V5c3RvcmVka2V5c3Q=:c2VydmVya2V5c2VydmVya2V5c2VydmVya2V5c2U="
)


def test_basic_quoting_and_comments() -> None:
    text = f"""
; PgBouncer-style comment
# another comment
"alice" "plain pass"
  "bob"   "{MD5}"   extra fields are ignored
"we""ird" "pa""ss"
"carol" "{SCRAM}"
"""
    assert parse_userlist(text) == {
        "alice": "plain pass",
        "bob": MD5,
        'we"ird': 'pa"ss',
        "carol": SCRAM,
    }


def test_empty_password_and_repeated_user() -> None:
    # PgBouncer keeps the last entry for a repeated user.
    assert parse_userlist('"a" ""\n"a" "second"\n') == {"a": "second"}


def test_empty_text() -> None:
    assert parse_userlist("") == {}
    assert parse_userlist("\n  \n; only comments\n") == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('"alice" "pw"\nalice pw\n', "users.txt:2: expected a double-quoted user name"),
        ('"alice"\n', "users.txt:1: expected a double-quoted password, found end of line"),
        ('"alice" pw\n', "users.txt:1: expected a double-quoted password, found 'pw'"),
        ('"alice" "pw\n', "users.txt:1: unterminated quoted password"),
        ('"ali\n', "users.txt:1: unterminated quoted user name"),
        ('\n\n"" "pw"\n', "users.txt:3: empty user name"),
    ],
)
def test_errors_carry_line_numbers(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_userlist(text, source="users.txt")
    assert str(info.value).startswith(expected)


def test_default_source_name() -> None:
    with pytest.raises(ConfigError, match=r"^auth_file:1: "):
        parse_userlist("junk")


def test_load_userlist(tmp_path: Path) -> None:
    path = tmp_path / "userlist.txt"
    path.write_text('"u" "p"\n')
    assert load_userlist(path) == {"u": "p"}
    with pytest.raises(ConfigError, match="cannot read auth_file"):
        load_userlist(tmp_path / "missing.txt")


def test_load_userlist_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "userlist.txt"
    path.write_text('"u" "p"\nbad\n')
    with pytest.raises(ConfigError, match=rf"^{path}:2: "):
        load_userlist(path)


@pytest.mark.parametrize(
    ("secret", "kind"),
    [
        (MD5, "md5"),
        (MD5.upper().replace("MD5", "md5"), "md5"),
        (SCRAM, "scram"),
        ("plain", "plain"),
        ("", "plain"),
        ("md5short", "plain"),
        (MD5 + "0", "plain"),
        ("SCRAM-SHA-256$garbage", "plain"),
    ],
)
def test_secret_kind(secret: str, kind: str) -> None:
    assert secret_kind(secret) == kind
