"""Statement texts of sessions with ``standard_conforming_strings = off``.

With the setting off, PostgreSQL reads a plain ``'...'`` literal the way it
reads ``E'...'``: a backslash escapes the next character, so ``'it\\'s'`` is
one literal. Everything else that reads SQL here (PostgreSQL's parser in
pglast, scry's lexer) assumes the setting is on, where ``'it\\'`` ends the
literal and ``s'`` starts another. Read that way, the rest of a literal shows
as SQL (words a client meant as data in the query ranking), and SQL can hide
inside what looks like a literal (a ``SET`` the hybrid pool would miss).

``standard_text`` writes such a text so that a reader assuming "on" sees the
same tokens PostgreSQL sees with "off": each plain literal becomes an ``E''``
literal (``N''``, which PostgreSQL reads as ``nchar ''``, becomes ``nchar E''``). Only texts with both a quote and a backslash can read differently;
the others come back unchanged.
"""

from __future__ import annotations

import re

__all__ = ["standard_text"]

_WORD_BYTE = re.compile(rb"[\w$\x80-\xff]")
# What can start a token that matters here, alternatives in the order
# PostgreSQL's lexer would prefer them at one position. Identifiers and
# keywords are matched whole, so that the "e" ending "some'..." is not taken
# for an E'' prefix nor the "$" inside "a$b$" for a dollar quote.
_TOKEN = re.compile(
    rb"""
     (?P<line>--[^\n\r]*)
    |(?P<block>/\*)
    |(?P<ident>(?:[Uu]&)?"(?:[^"]|"")*"?)
    |(?P<escape>[Ee]')
    |(?P<bits>[BbXx]')
    |(?P<unicode>[Uu]&')
    |(?P<plain>[Nn]?')
    |(?P<dollar>\$(?:[A-Za-z_\x80-\xff][\w\x80-\xff]*)?\$)
    |(?P<word>[\w\x80-\xff][\w$\x80-\xff]*)
    """,
    re.VERBOSE,
)
# Literal bodies after the opening quote, closing quote included when there is one.
_ESCAPED_BODY = re.compile(rb"(?:[^'\\]+|''|\\.)*'?", re.DOTALL)
_DOUBLED_BODY = re.compile(rb"(?:[^']+|'')*'?")
_BITS_BODY = re.compile(rb"[^']*'?")
# Two literals separated by whitespace holding a newline are one literal
# (SQL's continuation), read the way its first part is.
_CONTINUATION = re.compile(rb"(?:[ \t\f]|--[^\n\r]*)*[\n\r](?:[ \t\n\r\f\v]+|--[^\n\r]*[\n\r])*'")
_BLOCK_EDGE = re.compile(rb"/\*|\*/")


def standard_text(text: bytes) -> bytes:
    """``text`` (SQL as a session with standard_conforming_strings=off sends
    it) written for a reader that assumes the setting is on."""
    if b"\\" not in text or b"'" not in text:
        return text
    out: list[bytes] = []
    copied = pos = 0
    end_of_text = len(text)
    while (token := _TOKEN.search(text, pos)) is not None:
        kind = token.lastgroup
        start = pos = token.end()
        if kind == "block":
            pos = _block_end(text, start)
            continue
        if kind == "dollar":
            close = text.find(token.group(), start)
            pos = end_of_text if close < 0 else close + len(token.group())
            continue
        if kind == "plain":
            body = _ESCAPED_BODY
            if token.group()[:1] != b"'":  # N'...': PostgreSQL reads "nchar '...'"
                prefix = b"nchar E'"
            else:
                prefix = b" E'" if _follows_word(text, token.start()) else b"E'"
            out += (text[copied : token.start()], prefix)
            copied = start
        elif kind == "escape":
            body = _ESCAPED_BODY
        elif kind == "bits":
            body = _BITS_BODY
        elif kind == "unicode":
            body = _DOUBLED_BODY
        else:  # a word, a comment, a quoted identifier: nothing inside can start a literal
            continue
        while True:
            pos = body.match(text, pos).end()
            if text[pos - 1 : pos] != b"'" or pos == start:
                break  # unterminated: the literal runs to the end of the text
            more = _CONTINUATION.match(text, pos)
            if more is None:
                break
            start = pos = more.end()
    out.append(text[copied:])
    return b"".join(out)


def _follows_word(text: bytes, at: int) -> bool:
    return at > 0 and _WORD_BYTE.match(text, at - 1) is not None


def _block_end(text: bytes, pos: int) -> int:
    """Where the block comment opened just before ``pos`` ends (they nest)."""
    depth = 1
    for edge in _BLOCK_EDGE.finditer(text, pos):
        depth += 1 if edge.group() == b"/*" else -1
        if depth == 0:
            return edge.end()
    return len(text)
