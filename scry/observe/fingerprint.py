"""Query fingerprints: the same statement with other literals is the same query.

Three levels, cheapest first:

0. *variant key* -> ``Variant`` (``resolve``, the pipeline's per-record
   path): the text with every digit turned into ``0`` (one ``bytes.translate``,
   far cheaper than any regex pass), hashed (so the cache keeps no text). Texts that differ only in the digits of
   their literals share it, and because the cheap lexer's token boundaries
   depend on which bytes are digits, never on which digits, they also share
   their literal positions: a ``Variant`` carries the shape and the byte
   spans of its hot lookup values, so the drain slices values out without
   lexing. Digits outside literals (``t1``, ``int8``) are checked by value.
   Texts that need the full lexer (comments, quoted identifiers, dollar
   quotes, backslashes) are not kept here;
1. exact text -> ``Shape`` (a dict hit; only literal-free texts are kept,
   such as prepared statements with ``$n`` parameters and constant queries,
   because texts carrying values rarely repeat);
2. *shape key* -> ``Shape``: ``lexer.shape_of`` strips literals, comments,
   whitespace runs and list lengths with one precompiled regex pass;
3. a new shape goes through PostgreSQL's own parser (pglast): ``normalize``
   for the display text and the parse tree for the tables touched and the
   simple ``col = literal`` / ``col IN (...)`` lookups. A statement the
   parser refuses still gets a fingerprint from the lexer alone.

The fingerprint id is the first 16 hex digits of the Blake3 hash of the
canonical normalized form (``lexer.canonical``: no comments, one space
between tokens, unquoted words folded to lower case, literals and lists
collapsed). It depends only on the shape, so the caches never disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import blake3
import pglast
from pglast import ast
from pglast.parser import ParseError

from scry.observe.anonymize import Anonymizer
from scry.observe.lexer import (
    PLACEHOLDER,
    before_first_value,
    canonical,
    literal_spans,
    render,
    shape_of,
    tables_by_lexer,
)


class Shape:
    """What is known about one query shape; shared by all its texts."""

    __slots__ = (
        "fingerprint",
        "normalized",
        "tables",
        "parsed",
        "eq_lookups",
        "lookup_columns",
        "session_effects",
    )

    def __init__(
        self,
        fingerprint: str,
        normalized: str,
        tables: tuple[str, ...],
        parsed: bool,
        eq_lookups: tuple[tuple[int, str], ...],
        lookup_columns: dict[tuple[str | None, str], str],
    ) -> None:
        #: 16 hex digits.
        self.fingerprint = fingerprint
        #: Display text: literals as $n (leftovers hashed when anonymizing).
        self.normalized = normalized
        #: Tables touched, schema-qualified when the query qualified them.
        self.tables = tables
        #: False when PostgreSQL's parser refused the text (lexer fallback).
        self.parsed = parsed
        #: (literal ordinal, "table.column") for ``col = literal`` lookups,
        #: valid when the text's literal list was not collapsed.
        self.eq_lookups = eq_lookups
        #: (qualifier, column) -> "table.column" for every simple lookup.
        self.lookup_columns = lookup_columns
        #: What its statements do to session state (``scry.protocol.classify``),
        #: worked out by the pipeline from its first text when someone listens.
        self.session_effects: tuple[Any, ...] | None = None


#: ``bytes.translate`` table of the variant key: every digit becomes ``0``.
DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")


def variant_key(text: bytes) -> int:
    """The key of ``Fingerprinter.variants`` for a text: the ``hash`` of the
    text with its digits zeroed (so the cache holds no text a client sent;
    64 bits, keyed per process by Python's hash secret: a false hit among
    the at most ``max_variants`` keys is a 1-in-10^15 event per text). The
    pipeline computes it for a whole chunk (``columns.chunk_variants``)."""
    return hash(text.translate(DIGITS_TO_ZERO))


class Variant:
    """What the drain needs of the texts that share a variant key.

    ``spans``
        ``(prefix, start, end)`` per hot lookup value: the sketch key of the
        value is ``prefix + text[start:end]`` (prefix = ``b"table.column\0"``,
        string quotes outside the span).
    ``checks``
        None, or ``(start, end, digits)`` for each run of digits outside the
        literals: a text with this variant key is of this variant only if
        ``text[start:end] == digits`` (``t1`` and ``t2`` share a key).

    A *loose* variant (``Fingerprinter.loose``) stands for the texts of a
    shape that are not kept by variant key: no spans, their values come with
    each text.
    """

    __slots__ = ("shape", "spans", "checks")

    def __init__(
        self,
        shape: Shape,
        spans: tuple[tuple[bytes, int, int], ...] = (),
        checks: tuple[tuple[int, int, bytes], ...] | None = None,
    ) -> None:
        self.shape = shape
        self.spans = spans
        self.checks = checks

    def matches(self, text: bytes) -> bool:
        """Whether ``text`` (with this variant key) passes the digit checks."""
        return self.checks is None or all(text[s:e] == d for s, e, d in self.checks)


class VariantCache(dict[int, "Variant"]):
    """Variant key (``variant_key``) -> ``Variant``.

    ``get`` also accepts the digits-zeroed text itself (``bytes``), hashing
    it, for readers written when that was the key; the drain binds the plain
    ``dict.get`` (``VariantCache.lookup``) and keeps its C speed.
    """

    __slots__ = ()

    def get(self, key: Any, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, hash(key) if key.__class__ is bytes else key, default)

    @property
    def lookup(self) -> Callable[[int], Variant | None]:
        """``dict.get`` of this cache, by variant key only."""
        return dict.get.__get__(self)  # type: ignore[attr-defined,no-any-return]


_MAX_VARIANT_LEN = 4096
_MAX_VARIANTS_PER_SHAPE = 256  # beyond: values in the text itself (strings), not worth keeping
_DIGIT_RUN = re.compile(rb"[0-9]+")


class Fingerprinter:
    """Text -> ``Shape`` with bounded caches; ``lookup`` also returns the
    literal tokens of this very text (for hot-value sketches), ``resolve``
    the positions of its hot lookup values."""

    def __init__(
        self,
        anonymizer: Anonymizer | None,
        max_shapes: int = 20_000,
        max_texts: int = 10_000,
        max_variants: int = 20_000,
    ) -> None:
        self._anonymizer = anonymizer
        self._shapes: dict[bytes | str, Shape] = {}
        self._texts: dict[bytes, Shape] = {}
        self._max_shapes = max_shapes
        self._max_texts = max_texts
        #: Variant key -> Variant. The pipeline reads it directly (``.get``),
        #: so it is only ever cleared, never replaced.
        self.variants = VariantCache()
        self._variants_per_shape: dict[Shape, int] = {}
        self._loose: dict[Shape, Variant] = {}
        self._max_variants = max_variants
        #: How many texts went through PostgreSQL's parser (new shapes).
        self.parses = 0

    def resolve(self, text: bytes) -> tuple[Variant, tuple[bytes, ...]]:
        """The variant of a text that missed ``variants`` (or failed its
        digit checks), kept when other texts can share it, and the hot lookup
        value keys of this text when they are not at the variant's spans
        (a loose variant).

        ``text`` is the statement as the proxy recorded it: a trailing NUL
        (a Query body's terminator) is ignored.
        """
        raw = text[:-1] if text[-1:] == b"\x00" else text
        shape, literals, collapsed = self.lookup(raw)
        variants = self.variants
        if len(text) <= _MAX_VARIANT_LEN:
            key = variant_key(text)
            per_shape = self._variants_per_shape.get(shape, 0)
            if key not in variants and per_shape < _MAX_VARIANTS_PER_SHAPE:
                spans = literal_spans(raw)
                if spans is not None:
                    variant = Variant(
                        shape,
                        _value_spans(shape, raw, spans, collapsed),
                        _digit_checks(raw, spans),
                    )
                    if len(variants) >= self._max_variants:
                        variants.clear()
                        self._variants_per_shape.clear()
                        self._loose.clear()
                        per_shape = 0
                    variants[key] = variant
                    self._variants_per_shape[shape] = per_shape + 1
                    return variant, ()
        keys = tuple(
            value_key(column, literal)
            for column, literal in lookup_values(shape, raw, literals, collapsed)
        )
        return self.loose(shape), keys

    def cached_shape(self, text: bytes) -> Shape | None:
        """The shape of a text (as the proxy records it) when the variant
        cache already knows it; never parses."""
        variant = self.variants.get(variant_key(text))
        if variant is None or not variant.matches(text):
            return None
        return variant.shape

    def loose(self, shape: Shape) -> Variant:
        """The one loose variant of a shape."""
        variant = self._loose.get(shape)
        if variant is None:
            if len(self._loose) >= self._max_shapes:
                self._loose.clear()
            variant = self._loose[shape] = Variant(shape)
        return variant

    def lookup(self, text: bytes) -> tuple[Shape, list[Any], bool]:
        """(shape, literal tokens in order, whether a literal list was collapsed)."""
        shape = self._texts.get(text)
        if shape is not None:
            return shape, [], False
        key, literals, collapsed = shape_of(text)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._new_shape(text)
            if len(self._shapes) >= self._max_shapes:
                self._shapes.clear()  # cheap and rare; hot shapes come back at once
            self._shapes[key] = shape
        if not literals or (
            literals[0][:1] in (b"$", "$") and all(lit[:1] in (b"$", "$") for lit in literals)
        ):
            if len(self._texts) >= self._max_texts:
                self._texts.clear()
            self._texts[text] = shape
        return shape, literals, collapsed

    def fingerprint(self, text: bytes | str) -> Shape:
        """The shape of one text (a convenience over ``lookup``)."""
        if isinstance(text, str):
            text = text.encode("utf-8", "surrogatepass")
        return self.lookup(text)[0]

    def _new_shape(self, raw: bytes) -> Shape:
        self.parses += 1
        text = raw.decode("utf-8", "replace").replace("\0", "")
        literal = self._anonymizer.literal_token if self._anonymizer else (lambda _k, v: v)
        try:
            statements = pglast.parse_sql(text)
            normalized_raw = pglast.parser.normalize(text)
        except (ParseError, ValueError, RecursionError):
            # Shown (and its tables named) only up to its first value: see
            # lexer.before_first_value. The fingerprint still hashes it all.
            shown, cut = before_first_value(text)
            display = render(shown, None) + (" ..." if cut else "")
            return _shape(canonical(text), display, tables_by_lexer(shown), False, {})
        tables, columns = _tables_and_lookups(statements)
        # normalize() leaves literals in utility statements (SET, COPY, DDL):
        # render() hashes those when anonymizing.
        display = render(normalized_raw, literal)
        # Ordinals of lookup literals are counted in the client's own text,
        # the way shape_of counts them.
        eq = _eq_ordinals(canonical(text).replace("?", PLACEHOLDER), columns) if columns else ()
        return _shape(canonical(normalized_raw), display, tables, True, columns, eq)


def _shape(
    canon: str,
    display: str,
    tables: tuple[str, ...],
    parsed: bool,
    columns: dict[tuple[str | None, str], str],
    eq: tuple[tuple[int, str], ...] = (),
) -> Shape:
    fingerprint = blake3.blake3(canon.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return Shape(fingerprint, display, tables, parsed, eq, columns)


_LIT = rb"(?:[-+]\s*)?(?:[0-9][\w.]*(?:[eE][+-]?[0-9]+)?|'(?:[^']|'')*')"
_LOOKUP_B = re.compile(
    rb"(?i)(?:\b([A-Za-z_][\w$]*)\s*\.\s*)?\b([A-Za-z_][\w$]*)\s*(?:=\s*("
    + _LIT
    + rb")|\bIN\s*\(\s*("
    + _LIT
    + rb"(?:\s*,\s*"
    + _LIT
    + rb")*)\s*\))"
)
_LIT_B = re.compile(_LIT)


def lookup_values(
    shape: Shape, text: bytes, literals: list[Any], collapsed: bool
) -> list[tuple[str, Any]]:
    """("table.column", literal token) for each simple lookup value in this text.

    Bind parameters carry no value here and are skipped. Texts that needed
    the full lexer and also carry literal lists are skipped too (rare).
    """
    if not shape.lookup_columns or not literals:
        return []
    if shape.eq_lookups and not collapsed:
        n = len(literals)
        return [
            (label, literals[i])
            for i, label in shape.eq_lookups
            if i < n and literals[i][:1] not in (b"$", "$")
        ]
    if not isinstance(literals[0], bytes):
        return []
    found: list[tuple[str, Any]] = []
    columns = shape.lookup_columns
    for m in _LOOKUP_B.finditer(text):
        qualifier = m.group(1).decode().lower() if m.group(1) else None
        label = columns.get((qualifier, m.group(2).decode().lower()))
        if label is None:
            continue
        if m.group(3) is not None:
            found.append((label, m.group(3)))
        else:
            found.extend((label, v) for v in _LIT_B.findall(m.group(4)))
    return found


def value_key(column: str, literal: bytes | str) -> bytes:
    """The sketch key of one lookup value: ``table.column``, NUL, the literal
    token without its string quotes. Only ever hashed, never kept."""
    if isinstance(literal, str):
        literal = literal.encode("utf-8", "surrogatepass")
    if literal[:1] == b"'":
        literal = literal[1:-1]
    return column.encode("utf-8", "surrogatepass") + b"\0" + literal


def _value_span(column: str, text: bytes, start: int, end: int) -> tuple[bytes, int, int]:
    if text[start : start + 1] == b"'":
        start, end = start + 1, end - 1
    return column.encode("utf-8", "surrogatepass") + b"\0", start, end


def _value_spans(
    shape: Shape, text: bytes, spans: list[tuple[int, int]], collapsed: bool
) -> tuple[tuple[bytes, int, int], ...]:
    """``lookup_values`` as positions: the same values, for every text of the variant."""
    if not shape.lookup_columns or not spans:
        return ()
    if shape.eq_lookups and not collapsed:
        n = len(spans)
        return tuple(
            _value_span(label, text, *spans[i])
            for i, label in shape.eq_lookups
            if i < n and text[spans[i][0] : spans[i][0] + 1] != b"$"
        )
    found: list[tuple[bytes, int, int]] = []
    columns = shape.lookup_columns
    for m in _LOOKUP_B.finditer(text):
        qualifier = m.group(1).decode().lower() if m.group(1) else None
        label = columns.get((qualifier, m.group(2).decode().lower()))
        if label is None:
            continue
        if m.group(3) is not None:
            found.append(_value_span(label, text, *m.span(3)))
        else:
            found.extend(
                _value_span(label, text, *v.span()) for v in _LIT_B.finditer(text, *m.span(4))
            )
    return tuple(found)


def _digit_checks(
    text: bytes, spans: list[tuple[int, int]]
) -> tuple[tuple[int, int, bytes], ...] | None:
    """Runs of digits outside the literals: (start, end, digits)."""
    if not spans:
        blanked = text
    else:
        parts, pos = [], 0
        for start, end in spans:
            parts.append(text[pos:start])
            parts.append(b" " * (end - start))
            pos = end
        parts.append(text[pos:])
        blanked = b"".join(parts)
    checks = tuple((m.start(), m.end(), m.group()) for m in _DIGIT_RUN.finditer(blanked))
    return checks or None


_IDENT = r'(?:"(?:[^"]|"")+"|[a-z_][\w$]*)'
_EQ_PLACEHOLDER = re.compile(rf"(?:({_IDENT}) \. )?({_IDENT}) = \x00")


def _eq_ordinals(
    canon: str, columns: dict[tuple[str | None, str], str]
) -> tuple[tuple[int, str], ...]:
    """Literal ordinals of ``col = literal`` in a canonical form without lists."""
    if " in ( \0 )" in canon or " array [ \0 ]" in canon:
        return ()  # ordinals shift with list lengths: use the regex path
    found = []
    for m in _EQ_PLACEHOLDER.finditer(canon):
        label = columns.get((_ident(m.group(1)), _ident(m.group(2)) or ""))
        if label is not None:
            found.append((canon.count("\0", 0, m.end() - 1), label))
    return tuple(found)


def _ident(name: str | None) -> str | None:
    if name is None:
        return None
    return name[1:-1].replace('""', '"') if name.startswith('"') else name.lower()


# --------------------------------------------------------------------------- #
# The parse tree: tables touched and simple lookups
# --------------------------------------------------------------------------- #


def _tables_and_lookups(
    statements: tuple[Any, ...],
) -> tuple[tuple[str, ...], dict[tuple[str | None, str], str]]:
    tables: dict[str, None] = {}
    ctes: set[str] = set()
    for node in _walk(statements):
        if isinstance(node, ast.CommonTableExpr):
            ctes.add(node.ctename)
    for node in _walk(statements):
        if isinstance(node, ast.RangeVar) and not (
            node.schemaname is None and node.relname in ctes
        ):
            tables[_qualified(node)] = None
    columns: dict[tuple[str | None, str], str] = {}
    if len(statements) == 1:
        _collect_lookups(statements[0].stmt, columns)
    return tuple(tables), columns


def _walk(node: Any) -> Any:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple | list):
            stack.extend(item)
        elif isinstance(item, ast.Node):
            yield item
            for name in item:  # attribute names of the node
                value = getattr(item, name)
                if isinstance(value, ast.Node | tuple | list):
                    stack.append(value)


def _qualified(rv: Any) -> str:
    return f"{rv.schemaname}.{rv.relname}" if rv.schemaname else rv.relname


def _collect_lookups(stmt: Any, out: dict[tuple[str | None, str], str]) -> None:
    if isinstance(stmt, ast.SelectStmt):
        sources = stmt.fromClause or ()
    elif isinstance(stmt, ast.UpdateStmt):
        sources = (stmt.relation, *(stmt.fromClause or ()))
    elif isinstance(stmt, ast.DeleteStmt):
        sources = (stmt.relation, *(stmt.usingClause or ()))
    else:
        return
    if stmt.whereClause is None:
        return
    aliases: dict[str, str] = {}
    for source in _flatten_joins(sources):
        if isinstance(source, ast.RangeVar):
            name = _qualified(source)
            aliases[source.alias.aliasname if source.alias else source.relname] = name
    only = next(iter(aliases.values())) if len(aliases) == 1 else None
    for expr in _conjuncts(stmt.whereClause):
        column = _lookup_column(expr)
        if column is None:
            continue
        qualifier, name = column
        table = aliases.get(qualifier) if qualifier else only
        if table is not None:
            out[(qualifier, name)] = f"{table}.{name}"


def _flatten_joins(sources: Any) -> list[Any]:
    out: list[Any] = []
    for source in sources:
        if isinstance(source, ast.JoinExpr):
            out.extend(_flatten_joins((source.larg, source.rarg)))
        else:
            out.append(source)
    return out


def _conjuncts(expr: Any) -> list[Any]:
    if isinstance(expr, ast.BoolExpr) and expr.boolop == pglast.enums.BoolExprType.AND_EXPR:
        return [e for arg in expr.args for e in _conjuncts(arg)]
    return [expr]


def _is_value(node: Any) -> bool:
    if isinstance(node, ast.TypeCast):
        node = node.arg
    return isinstance(node, ast.A_Const | ast.ParamRef)


def _lookup_column(expr: Any) -> tuple[str | None, str] | None:
    if not isinstance(expr, ast.A_Expr) or not isinstance(expr.lexpr, ast.ColumnRef):
        return None
    kind = expr.kind
    if kind == pglast.enums.A_Expr_Kind.AEXPR_OP:
        if len(expr.name) != 1 or expr.name[0].sval != "=" or not _is_value(expr.rexpr):
            return None
    elif kind == pglast.enums.A_Expr_Kind.AEXPR_IN:
        if not isinstance(expr.rexpr, tuple) or not all(_is_value(v) for v in expr.rexpr):
            return None
    else:
        return None
    fields = [f.sval for f in expr.lexpr.fields if isinstance(f, ast.String)]
    if len(fields) != len(expr.lexpr.fields) or not 1 <= len(fields) <= 2:
        return None
    return (fields[0] if len(fields) == 2 else None), fields[-1]
