"""A small SQL lexer: the cheap per-query shape pass and the full tokenizer.

Two tools live here, both pure functions over query text:

``shape_of(text)``
    The per-query pass, run for every record off the hot path. It replaces
    every literal (number, quoted string, ``$n`` parameter) with a NUL byte,
    collapses whitespace and ``IN (...)`` / ``ARRAY[...]`` lists, and returns
    the result (the *shape key*) together with the literal tokens in order.
    PostgreSQL query text never contains NUL, so the placeholder cannot
    collide with anything a client sends. Texts without comments, quoted
    identifiers, backslashes or dollar quotes (nearly all machine-generated
    SQL) take a single precompiled ``re.split`` over the bytes; the rest take
    the full tokenizer. Shape keys are internal dictionary keys only: they are
    never exported.

``tokenize(text)`` and friends
    The full tokenizer, run once per *new* shape: comments (nested block
    comments too), dollar quotes, ``E''`` strings with backslash escapes,
    quoted identifiers, unterminated literals (to the end of the text). It
    feeds ``canonical`` (the form whose hash is the fingerprint id),
    ``render`` (the display text) and the anonymizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

PLACEHOLDER = "\0"

# --------------------------------------------------------------------------- #
# The cheap shape pass (bytes)
# --------------------------------------------------------------------------- #

# Begins with a character class so the regex engine can skip to candidates
# quickly; lookbehinds after the first character keep digits inside
# identifiers (t1, a$1) out.
_FAST_LITERAL = re.compile(
    rb"([0-9.'$](?:"
    rb"(?<=')(?:[^']|'')*'"
    rb"|(?<![\w$]\$)(?<=\$)[0-9]+"
    rb"|(?<![\w$][0-9])(?<=[0-9])[0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?"
    rb"|(?<![\w$]\.)(?<=\.)[0-9][0-9_]*(?:[eE][+-]?[0-9]+)?"
    rb"))"
)
# A character-class scan is much cheaper than an alternation of the cases.
_MAYBE_SPECIAL = re.compile(rb'[-"\\/$]')
_DOLLAR_QUOTE = re.compile(rb"\$(?:[A-Za-z_\x80-\xff][\w\x80-\xff]*)?\$")
_LIST_B = re.compile(
    rb"(?i)(\bIN\s*\(|\bARRAY\s*\[)\s*[-+]?\s*\x00(?:\s*,\s*[-+]?\s*\x00)*\s*([)\]])"
)
_LIST_S = re.compile(
    r"(?i)(\bIN\s*\(|\bARRAY\s*\[)\s*[-+]?\s*\x00(?:\s*,\s*[-+]?\s*\x00)*\s*([)\]])"
)


def shape_of(text: bytes) -> tuple[bytes | str, list[bytes] | list[str], bool]:
    """Return (shape key, literal tokens in order, whether a list was collapsed).

    Texts that differ only in literal values, whitespace runs, comments or
    the length of literal-only ``IN``/``ARRAY`` lists share a shape key.
    """
    if _MAYBE_SPECIAL.search(text) is None or not _needs_full_lexer(text):
        parts = _FAST_LITERAL.split(text)
        if len(parts) == 1:
            return b" ".join(text.split()), [], False
        literals = parts[1::2]
        shape = b" ".join(b"\0".join(parts[0::2]).split())
        if b"\0," in shape or b"\0 ," in shape:
            collapsed = _LIST_B.sub(rb"\1\0\2", shape)
            return collapsed, literals, len(collapsed) != len(shape)
        return shape, literals, False
    return _slow_shape(text.decode("utf-8", "replace"))


def literal_spans(text: bytes) -> list[tuple[int, int]] | None:
    """(start, end) of each literal token ``shape_of`` finds in ``text``, or
    None when the text needs the full lexer (comments, quoted identifiers,
    backslashes, dollar quotes): its tokens then depend on more than which
    bytes are digits."""
    if _MAYBE_SPECIAL.search(text) is not None and _needs_full_lexer(text):
        return None
    return [m.span() for m in _FAST_LITERAL.finditer(text)]


def _needs_full_lexer(text: bytes) -> bool:
    return (
        b'"' in text
        or b"\\" in text
        or b"--" in text
        or b"/*" in text
        or (b"$" in text and _DOLLAR_QUOTE.search(text) is not None)
    )


def _slow_shape(text: str) -> tuple[str, list[str], bool]:
    out: list[str] = []
    literals: list[str] = []
    for kind, value in tokenize(text):
        if kind in _LITERAL_KINDS:
            literals.append(value)
            out.append(PLACEHOLDER)
        elif kind != "comment":
            out.append(value)
    shape = " ".join(out)
    collapsed = _LIST_S.sub(r"\1\0\2", shape)
    return collapsed, literals, len(collapsed) != len(shape)


# --------------------------------------------------------------------------- #
# The full tokenizer (str)
# --------------------------------------------------------------------------- #

_IDENT_START = r"A-Za-z_\x80-\U0010ffff"
_TOKEN = re.compile(
    rf"""
     (?P<ws>\s+)
    |(?P<comment>--[^\n]*)
    |(?P<bcomment>/\*)
    |(?P<estring>[eE]'(?:[^'\\]|\\.|'')*(?:'|\\?\Z))
    |(?P<string>(?:[bBxXnN]|[uU]&)?'(?:[^']|'')*(?:'|\Z))
    |(?P<dollar>\$(?:[{_IDENT_START}][\w\x80-\U0010ffff]*)?\$)
    |(?P<param>\$[0-9]+)
    |(?P<qident>(?:[uU]&)?"(?:[^"]|"")*(?:"|\Z))
    |(?P<number>0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+
        |(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9]+)?)
    |(?P<word>[{_IDENT_START}][\w$\x80-\U0010ffff]*)
    |(?P<op>::|<>|!=|<=|>=|\|\||->>?|\#>>?|@>|<@|=>|:=|.)
    """,
    re.VERBOSE | re.DOTALL,
)

#: Token kinds that carry a value a client chose: replaced or hashed.
_LITERAL_KINDS = frozenset({"string", "estring", "dollar", "number", "param"})
LITERAL_KINDS = _LITERAL_KINDS


def tokenize(text: str) -> Iterator[tuple[str, str]]:
    """Yield (kind, text) tokens; kinds: comment, string, estring, dollar,
    param, qident, number, word, op. Whitespace is skipped."""
    pos, end = 0, len(text)
    match = _TOKEN.match
    while pos < end:
        m = match(text, pos)
        assert m is not None  # the op alternative matches any character
        kind = m.lastgroup
        stop = m.end()
        if kind == "ws":
            pos = stop
            continue
        if kind == "bcomment":
            stop = _block_comment_end(text, pos)
            yield "comment", text[pos:stop]
        elif kind == "dollar":
            tag = m.group()
            close = text.find(tag, stop)
            stop = end if close < 0 else close + len(tag)
            yield "dollar", text[pos:stop]
        else:
            yield kind, m.group()  # type: ignore[misc]
        pos = stop


def _block_comment_end(text: str, pos: int) -> int:
    depth, i, end = 0, pos, len(text)
    while i < end:
        two = text[i : i + 2]
        if two == "/*":
            depth += 1
            i += 2
        elif two == "*/":
            depth -= 1
            i += 2
            if depth == 0:
                return i
        else:
            i += 1
    return end


# Words after which "(" opens a list or subquery rather than a call, and after
# which a +/- starts a signed literal rather than a subtraction.
_KEYWORDS = frozenset(
    {
        "select",
        "where",
        "and",
        "or",
        "not",
        "in",
        "values",
        "as",
        "from",
        "join",
        "on",
        "using",
        "when",
        "then",
        "else",
        "case",
        "return",
        "returning",
        "limit",
        "offset",
        "by",
        "is",
        "between",
        "like",
        "ilike",
        "exists",
        "any",
        "all",
        "some",
        "set",
        "having",
        "with",
        "distinct",
        "into",
    }
)


def _sign_merged(tokens: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Fold a unary +/- into the number after it (``= -5`` is one literal)."""
    out: list[tuple[str, str]] = []
    for kind, value in tokens:
        if kind == "number" and out and out[-1] in (("op", "-"), ("op", "+")):
            before = out[-2] if len(out) > 1 else None
            if (
                before is None
                or (before[0] == "op" and before[1] not in (")", "]"))
                or (before[0] == "word" and before[1].lower() in _KEYWORDS)
            ):
                value = out.pop()[1] + value
        out.append((kind, value))
    return out


_LIST_OPENERS = {"in": ("(", ")"), "array": ("[", "]")}


def _collapse_lists(tokens: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Collapse ``IN (lit, lit, ...)`` and ``ARRAY[lit, ...]`` to their first
    item, marked with a third element: how many items the list had."""
    out: list[tuple[str, ...]] = []
    i, n = 0, len(tokens)
    while i < n:
        token = tokens[i]
        out.append(token)
        i += 1
        brackets = _LIST_OPENERS.get(token[1].lower()) if token[0] == "word" else None
        if brackets is None or i >= n or tokens[i] != ("op", brackets[0]):
            continue
        j, items = i + 1, 0
        while j < n and tokens[j][0] in _LITERAL_KINDS:
            items += 1
            j += 1
            if j < n and tokens[j] == ("op", ","):
                j += 1
                continue
            break
        if items and j < n and tokens[j] == ("op", brackets[1]) and tokens[j - 1][0] != "op":
            out.append(tokens[i])
            out.append((*tokens[i + 1], str(items)))
            out.append(tokens[j])
            i = j + 1
    return out


def canonical(text: str) -> str:
    """The form hashed into a fingerprint id: no comments, one space between
    tokens, unquoted words lower-cased (PostgreSQL folds them), every literal
    and parameter ``?``, literal lists collapsed to one item, no trailing ``;``."""
    tokens = _collapse_lists(_sign_merged([t for t in tokenize(text) if t[0] != "comment"]))
    while tokens and tokens[-1] == ("op", ";"):
        tokens.pop()
    parts = []
    for token in tokens:
        kind, value = token[0], token[1]
        if kind in _LITERAL_KINDS:
            parts.append("?")
        elif kind == "word":
            parts.append(value.lower())
        else:
            parts.append(value)
    return " ".join(parts)


def render(text: str, literal: Callable[[str, str], str] | None) -> str:
    """The display form: comments dropped, whitespace runs collapsed, literal
    lists collapsed to ``first, ...``, and parameters renumbered ``$1..$n``.

    ``literal(kind, value)`` rewrites each literal that is not a parameter;
    with ``None`` such literals become parameters too.
    """
    out: list[str] = []
    number = 0
    prev = ("", "")
    for token in _collapse_lists(_sign_merged([t for t in tokenize(text) if t[0] != "comment"])):
        kind, value = token[0], token[1]
        if kind == "param" or (kind in _LITERAL_KINDS and literal is None):
            number += 1
            value = f"${number}"
        elif kind in _LITERAL_KINDS:
            assert literal is not None
            value = literal(kind, value)
        if len(token) == 3 and token[2] != "1":
            value += ", ..."
        if out and _space_between(prev, (kind, value)):
            out.append(" ")
        out.append(value)
        prev = (kind, value)
    return "".join(out)


def before_first_value(text: str) -> tuple[str, bool]:
    """The tokens of ``text`` before its first literal or quoted identifier
    (comments dropped), and whether anything came after them.

    For a statement PostgreSQL's parser refused: past a quote that does not
    pair up (an unescaped apostrophe, 'O'Brien', or an unterminated "name),
    the lexer cannot tell values from words, so nothing from there is shown.
    """
    kept: list[str] = []
    for kind, value in tokenize(text):
        if kind in _LITERAL_KINDS or kind == "qident":
            return " ".join(kept), True
        if kind != "comment":
            kept.append(value)
    return " ".join(kept), False


def _space_between(prev: tuple[str, str], nxt: tuple[str, str]) -> bool:
    # Keep "t.a", "f(x)", "a, b", "x::int" tight; everything else one space.
    if prev[1] in ("(", "[", ".", "::") or nxt[1] in (",", ")", "]", ";", ".", "::"):
        return False
    if nxt[1] in ("(", "["):
        return not (prev[0] in ("word", "qident") and prev[1].lower() not in _KEYWORDS)
    return True


# Tables from text, for statements PostgreSQL's parser refused.
_TABLE_AFTER = re.compile(
    r'(?i)\b(?:FROM|JOIN|UPDATE|INTO|TABLE)\s+((?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*)'
    r'(?:\s*\.\s*(?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*))?)'
)
_KEYWORDS_NOT_TABLES = frozenset({"select", "lateral", "only", "values", "unnest"})


def tables_by_lexer(text: str) -> tuple[str, ...]:
    """Best-effort table names after FROM/JOIN/UPDATE/INTO/TABLE."""
    found: dict[str, None] = {}
    cleaned = " ".join(v for k, v in tokenize(text) if k not in _LITERAL_KINDS | {"comment"})
    for m in _TABLE_AFTER.finditer(cleaned):
        name = re.sub(r"\s+", "", m.group(1))
        name = ".".join(
            p[1:-1].replace('""', '"') if p.startswith('"') else p.lower() for p in name.split(".")
        )
        if name not in _KEYWORDS_NOT_TABLES:
            found[name] = None
    return tuple(found)
