"""PgBouncer's ``auth_file`` (userlist.txt) format.

Each line is ``"username" "password"``: both fields double-quoted, ``""``
inside quotes stands for one literal ``"``. Blank lines and lines starting
with ``;`` or ``#`` are comments; anything after the password is ignored (as
PgBouncer does). The password is plaintext, an md5 secret (``md5`` + 32 hex
digits) or a SCRAM secret (``SCRAM-SHA-256$<iter>:<salt>$<stored>:<server>``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from scry.config import ConfigError

__all__ = ["load_userlist", "parse_userlist", "read_quoted", "secret_kind"]

_MD5_SECRET = re.compile(r"md5[0-9a-fA-F]{32}")
_SCRAM_SECRET = re.compile(r"SCRAM-SHA-256\$\d+:[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+:[A-Za-z0-9+/=]+")


def read_quoted(line: str, pos: int, what: str, where: str) -> tuple[str, int]:
    """Read one double-quoted field starting at or after ``pos``; return (value, next pos)."""
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    if pos >= len(line) or line[pos] != '"':
        found = repr(line[pos:]) if pos < len(line) else "end of line"
        raise ConfigError(f"{where}: expected a double-quoted {what}, found {found}")
    pos += 1
    chars: list[str] = []
    while pos < len(line):
        ch = line[pos]
        if ch == '"':
            if line.startswith('""', pos):  # doubled quote = literal quote
                chars.append('"')
                pos += 2
                continue
            return "".join(chars), pos + 1
        chars.append(ch)
        pos += 1
    raise ConfigError(f"{where}: unterminated quoted {what}")


def parse_userlist(text: str, source: str = "auth_file") -> dict[str, str]:
    """Parse userlist.txt content into ``{username: secret}``.

    Raises :class:`~scry.config.ConfigError` as ``"<source>:<lineno>: ..."`` on
    a malformed line. A user listed twice keeps the last password, as in PgBouncer.
    """
    users: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        where = f"{source}:{lineno}"
        name, pos = read_quoted(line, 0, "user name", where)
        password, _ = read_quoted(line, pos, "password", where)
        if not name:
            raise ConfigError(f"{where}: empty user name")
        # Like PgBouncer: the rest of the line is ignored, a repeated user wins.
        users[name] = password
    return users


def load_userlist(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read and parse a userlist.txt file; a missing file is a ConfigError."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read auth_file: {exc.strerror or exc}") from None
    return parse_userlist(text, source=source)


def secret_kind(secret: str) -> Literal["plain", "md5", "scram"]:
    """Classify a stored password: a SCRAM secret, an md5 secret, or plaintext."""
    if _SCRAM_SECRET.fullmatch(secret):
        return "scram"
    if _MD5_SECRET.fullmatch(secret):
        return "md5"
    return "plain"
