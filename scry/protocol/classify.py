"""What a statement text does to session state: the hybrid pool mode's classifier.

``classify(sql)`` returns the ordered :class:`Effect` s a simple-protocol Query
text (one or several ``;``-separated statements) has on the server session:
pins (state the client will expect on its next transaction), unpins (state it
cleared) and ``unpin_all`` (DISCARD ALL). :class:`scry.protocol.session_state.
SessionState` folds them into the per-client tracker.

It runs on every query, so it has two paths:

* **Fast path** (no parsing, well under a microsecond): a text whose first
  keyword, after whitespace and comments, is a plain DML / transaction-control
  keyword (``SELECT``, ``INSERT``, ``BEGIN``, ...), that holds a single
  statement and mentions none of the risky words (``advisory``,
  ``set_config``, ``pg_settings``, ``U&`` identifiers, and ``into`` unless it
  is an INSERT/MERGE) is stateless. Any doubt goes to the slow path: a false
  alarm costs a parse, a false "stateless" would lose a client's state.
* **Slow path**: PostgreSQL's own parser (pglast ``parse_sql_json``, several
  times faster than building pglast's Python AST), memoised in an LRU cache
  keyed by the text, so repeated SET/PREPARE texts cost a dictionary lookup.

Within one text the classifier also plays the transaction-control statements
it contains: ``BEGIN; SET a = 1; ROLLBACK`` has no net effect, and
``SAVEPOINT s; SET a = 1; ROLLBACK TO s`` neither. Effects of a transaction
opened by an earlier query are the tracker's business (commit/rollback).

Texts the parser rejects are (nearly always) rejected by the server too, and
effects are only applied after the server reports success. The one exception
is version skew: a server newer than pglast's grammar may accept syntax pglast
cannot parse. For those a token-level fallback pins the client conservatively
(reason ``session_other``, not replayable) when a statement starts with a
state-changing keyword or mentions a risky function.

Not detectable, hence treated as stateless: state changed *inside* functions,
procedures and DO blocks (``DO $$ ... PERFORM pg_advisory_lock(1) ... $$``, a
user function calling ``set_config``). Their bodies are opaque strings or live
in the catalog; see docs/hybrid.md and prefer ``pool.mode: session`` for such
applications.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from pglast.parser import ParseError, parse_sql_json, scan

__all__ = [
    "Effect",
    "Op",
    "Reason",
    "classify",
    "classify_bytes",
    "is_stateless_fast",
    "quote_literal",
]

Op = Literal["pin", "unpin", "unpin_all"]
Reason = Literal[
    "set", "prepare", "temp_table", "cursor", "advisory_lock", "listen", "load", "session_other"
]


class Effect(NamedTuple):
    """One change a statement makes to the server session's state.

    ``key`` names the object (variable, prepared statement, temp table,
    cursor, channel); ``None`` means "all of that reason". ``replay`` is SQL
    that re-creates the state on a fresh server (``None``: not replayable).
    ``transactional`` effects are undone when the enclosing transaction rolls
    back; the others (PREPARE, DEALLOCATE, CLOSE, advisory locks, LOAD) stick.
    """

    op: Op
    reason: Reason
    key: str | None
    replay: str | None
    transactional: bool


NO_EFFECTS: tuple[Effect, ...] = ()
CACHE_SIZE = 4096
CACHE_MAX_TEXT = 4096  # characters; longer texts are parsed every time

# -- fast path ---------------------------------------------------------------
# PostgreSQL whitespace and comments before the first keyword. A block
# comment's body may not contain "/*": PostgreSQL nests block comments, and a
# nested one must not make us read a keyword that is really inside a comment
# (such texts simply fail this pattern and take the slow path).
# Atomic, so that backtracking cannot end a "--" comment before its line does.
_LEAD = r"(?>(?:[ \t\n\r\f\v]+|--[^\n\r]*|/\*(?:[^*/]|\*(?!/)|/(?!\*))*\*/)*)"
# Keywords that start statements which cannot create session state by
# themselves. Deliberately absent: SET, RESET, PREPARE, DEALLOCATE, CREATE,
# DROP, DECLARE, CLOSE, LISTEN, UNLISTEN, LOAD, DISCARD, EXPLAIN (EXPLAIN
# ANALYZE executes its statement), DO.
_SAFE_WORDS = (
    "select", "insert", "update", "delete", "merge", "with", "values", "table", "begin",
    "start", "commit", "end", "rollback", "abort", "savepoint", "release", "show", "fetch",
    "move", "execute", "copy", "call", "notify", "lock", "truncate",
)  # fmt: skip
# Statements that legitimately contain "into"; for the others it may be SELECT ... INTO.
_INTO_OK = ("insert", "merge")
_SAFE_KEYWORDS = (
    "(?:(" + "|".join(_INTO_OK) + ")|" + "|".join(w for w in _SAFE_WORDS if w not in _INTO_OK) + ")"
)
_FAST_STR = re.compile(_LEAD + _SAFE_KEYWORDS + r"(?![\w$])")
# The common layout "keyword ..." (or a bare keyword) is looked up without the
# regex: first word -> may the text contain "into"?
_FIRST_WORD = {word: word in _INTO_OK for word in _SAFE_WORDS}
# The same, for scry/_relay.pyx's copy of _fast_str's common case (its bytes-level
# twin, held to the same answers by tests/unit/test_classify.py).
STATELESS_FIRST_WORDS = {word.encode(): into_ok for word, into_ok in _FIRST_WORD.items()}
_HEAD = 10  # longer than the longest keyword, so a head equal to a keyword is the keyword
# A Query body's terminating NUL may be left on the text.
_PG_SPACE_OR_NUL = " \t\n\r\f\v\x00"


def _fast_str(lowered: str) -> bool:
    """True when ``lowered`` (a lower-cased statement text) is provably stateless.

    Every check only ever answers "stateless" or "don't know": the cost of a
    wrong "don't know" is one parse, the cost of a wrong "stateless" is a
    client silently losing its session state.
    """
    into_ok = _FIRST_WORD.get(lowered[:_HEAD].split(" ", 1)[0])
    if into_ok is None:
        m = _FAST_STR.match(lowered)
        if m is None:
            return False
        into_ok = m.lastindex is not None
    if (
        "advisory" in lowered
        or "set_config" in lowered
        or "pg_settings" in lowered
        or "u&" in lowered
        or (not into_ok and "into" in lowered)
    ):
        return False
    i = lowered.find(";")
    # A ";" followed by anything but whitespace may start a second statement.
    return i < 0 or i == len(lowered) - 1 or not lowered[i + 1 :].strip(_PG_SPACE_OR_NUL)


def is_stateless_fast(sql: str) -> bool:
    """The fast path alone: True only if ``sql`` certainly has no effects.

    False means "unknown" (the slow path decides), never "stateful".
    """
    return _fast_str(sql.lower())


def classify(sql: str) -> tuple[Effect, ...]:
    """The ordered effects of the statement text ``sql`` on session state."""
    if _fast_str(sql.lower()):
        return NO_EFFECTS
    return _classify_cached(sql) if len(sql) <= CACHE_MAX_TEXT else _classify(sql)


def classify_bytes(body: bytes) -> tuple[Effect, ...]:
    """:func:`classify` for a Query message body as received (NUL-terminated or not).

    Decoding costs less than any bytes-level scan would (bytes ``in`` is
    several times slower than str ``in``). A body that is not UTF-8 is decoded
    as Latin-1 so that its ASCII keywords still classify; names and replay
    texts with non-ASCII bytes are then only right for LATIN1 clients.
    """
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.decode("latin-1")
    if _fast_str(text.lower()):
        return NO_EFFECTS
    text = text.rstrip("\x00")
    return _classify_cached(text) if len(text) <= CACHE_MAX_TEXT else _classify(text)


# -- slow path ---------------------------------------------------------------
# Node names (JSON keys) and function names that can matter. A parse tree whose
# JSON mentions none of them has no effects, and json.loads is skipped. Over-
# matching (a string constant that says "set_config") only costs time.
_INTERESTING = re.compile(
    r'"(?:VariableSetStmt|PrepareStmt|DeallocateStmt|CreateStmt|CreateTableAsStmt|ViewStmt'
    r"|CreateSeqStmt|CreateFunctionStmt|intoClause|DropStmt|DiscardStmt|DeclareCursorStmt"
    r'|ClosePortalStmt|ListenStmt|UnlistenStmt|LoadStmt)"|advisory|set_config|pg_settings'
)
_ADVISORY_LOCK = frozenset(
    {
        "pg_advisory_lock",
        "pg_advisory_lock_shared",
        "pg_try_advisory_lock",
        "pg_try_advisory_lock_shared",
    }
)
_ADVISORY_UNLOCK = frozenset({"pg_advisory_unlock", "pg_advisory_unlock_shared"})
_CURSOR_OPT_HOLD = 0x0020  # parsenodes.h
# GUCs a plain SET cannot make outlive the transaction (SET transaction_isolation = ...).
_TRANSACTION_SCOPED = frozenset(
    {"transaction_isolation", "transaction_read_only", "transaction_deferrable"}
)
_TRUE_WORDS = frozenset({"t", "true", "y", "yes", "on", "1"})
_FALSE_WORDS = frozenset({"f", "false", "n", "no", "off", "0"})
_DROPPABLE = frozenset(
    {"OBJECT_TABLE", "OBJECT_VIEW", "OBJECT_SEQUENCE", "OBJECT_FUNCTION", "OBJECT_FOREIGN_TABLE"}
)

_Node = dict[str, Any]


def _classify(sql: str) -> tuple[Effect, ...]:
    """The slow path: parse ``sql`` and walk its statements."""
    try:
        source = sql.encode()
    except UnicodeEncodeError:  # lone surrogates, e.g. from a surrogateescape decode
        sql = sql.encode(errors="surrogatepass").decode(errors="replace")
        source = sql.encode()
    try:
        tree_json = parse_sql_json(sql)
    except ParseError:
        return _fallback(sql)
    if _INTERESTING.search(tree_json) is None:
        return NO_EFFECTS
    walk_functions = (
        "advisory" in tree_json or "set_config" in tree_json or "pg_settings" in tree_json
    )
    effects: list[Effect] = []
    txn_start = 0  # index in effects where the current (possibly implicit) transaction began
    savepoints: dict[str, int] = {}
    for raw in json.loads(tree_json)["stmts"]:
        ((kind, body),) = raw["stmt"].items()
        if kind == "TransactionStmt":
            txn_start = _play_transaction(body, effects, txn_start, savepoints)
            continue
        start = raw.get("stmt_location", 0)
        length = raw.get("stmt_len")
        stmt_bytes = source[start : start + length] if length else source[start:]
        text = stmt_bytes.decode()
        effects.extend(_statement_effects(kind, body, text))
        if walk_functions:
            effects.extend(_function_effects(kind, body))
    return tuple(effects)


# Texts are cached whole; long ones (bulk loads, generated SQL) would make
# the cache's memory unbounded and rarely repeat anyway.
_classify_cached = lru_cache(maxsize=CACHE_SIZE)(_classify)


def _play_transaction(
    body: _Node, effects: list[Effect], txn_start: int, savepoints: dict[str, int]
) -> int:
    """Apply a transaction-control statement to ``effects``; return the new txn start."""
    kind = body.get("kind")
    if kind in ("TRANS_STMT_BEGIN", "TRANS_STMT_START", "TRANS_STMT_COMMIT", "TRANS_STMT_PREPARE"):
        savepoints.clear()
        return len(effects)
    if kind == "TRANS_STMT_ROLLBACK":
        _drop_transactional(effects, txn_start)
        savepoints.clear()
        return len(effects)
    if kind == "TRANS_STMT_SAVEPOINT":
        savepoints[body.get("savepoint_name", "")] = len(effects)
    elif kind == "TRANS_STMT_ROLLBACK_TO":
        # A savepoint set by an earlier query is unknown here: its effects stay
        # (the tracker keeps them too; see docs/hybrid.md).
        mark = savepoints.get(body.get("savepoint_name", ""))
        if mark is not None:
            _drop_transactional(effects, mark)
            for name, at in list(savepoints.items()):
                if at > len(effects):
                    del savepoints[name]
    return txn_start


def _drop_transactional(effects: list[Effect], start: int) -> None:
    effects[start:] = [e for e in effects[start:] if not e.transactional]


_COMMENT_TOKENS = frozenset({"C_COMMENT", "SQL_COMMENT"})


def _trim(text: str) -> str:
    """The statement without leading/trailing whitespace, comments and ``;``.

    Replay texts are sent on their own or joined, so a trailing ``--`` comment
    must not survive.
    """
    try:
        tokens = [t for t in scan(text) if t.name not in _COMMENT_TOKENS]
    except ParseError:
        return text.strip()
    while tokens and tokens[-1].name == "ASCII_59":
        tokens.pop()
    if not tokens:
        return text.strip()
    return text[tokens[0].start : tokens[-1].end + 1]


def _statement_effects(kind: str, body: _Node, text: str) -> list[Effect]:
    """Effects of one top-level statement (function calls aside); ``text`` is its source."""
    if kind == "VariableSetStmt":
        return _set_effects(body, text)
    if kind == "PrepareStmt":
        return [Effect("pin", "prepare", body["name"], _trim(text), False)]
    if kind == "DeallocateStmt":
        return [Effect("unpin", "prepare", body.get("name"), None, False)]
    if kind in ("CreateStmt", "CreateSeqStmt", "ViewStmt"):
        relation = body.get("relation") or body.get("sequence") or body.get("view") or {}
        if body.get("oncommit") == "ONCOMMIT_DROP":
            return []
        return _temp_relation(relation)
    if kind == "CreateTableAsStmt":
        into = body.get("into", {})
        if into.get("onCommit") == "ONCOMMIT_DROP":
            return []
        return _temp_relation(into.get("rel", {}))
    if kind == "SelectStmt":
        while "larg" in body:  # SELECT ... INTO t UNION ...: INTO sits on the leftmost leaf
            body = body["larg"]
        into = body.get("intoClause")
        if into is None or into.get("onCommit") == "ONCOMMIT_DROP":
            return []
        return _temp_relation(into.get("rel", {}))
    if kind == "CreateFunctionStmt":
        names = [n["String"]["sval"] for n in body.get("funcname", [])]
        if len(names) == 2 and names[0].startswith("pg_temp"):
            return [Effect("pin", "temp_table", names[1], None, True)]
        return []
    if kind == "DropStmt":
        return _drop_effects(body)
    if kind == "DiscardStmt":
        target = body.get("target")
        if target == "DISCARD_ALL":
            return [Effect("unpin_all", "session_other", None, None, False)]
        if target == "DISCARD_TEMP":
            return [Effect("unpin", "temp_table", None, None, True)]
        return []
    if kind == "DeclareCursorStmt":
        if body.get("options", 0) & _CURSOR_OPT_HOLD:
            return [Effect("pin", "cursor", body["portalname"], None, True)]
        return []
    if kind == "ClosePortalStmt":
        # Closing a cursor is not undone by rolling back the transaction that closed it.
        return [Effect("unpin", "cursor", body.get("portalname"), None, False)]
    if kind == "ListenStmt":
        return [Effect("pin", "listen", body["conditionname"], None, True)]
    if kind == "UnlistenStmt":
        return [Effect("unpin", "listen", body.get("conditionname"), None, True)]
    if kind == "LoadStmt":
        return [Effect("pin", "load", body.get("filename"), None, False)]
    if kind == "ExplainStmt" and _explain_executes(body):
        ((inner_kind, inner),) = body["query"].items()
        return _statement_effects(inner_kind, inner, text)
    return []


def _set_effects(body: _Node, text: str) -> list[Effect]:
    if body.get("is_local"):
        return []
    kind = body["kind"]
    if kind == "VAR_RESET_ALL":
        return [Effect("unpin", "set", None, None, True)]
    name = body["name"].lower()
    if kind in ("VAR_SET_DEFAULT", "VAR_RESET"):
        return [Effect("unpin", "set", name, None, True)]
    if kind == "VAR_SET_MULTI":
        if name != "session characteristics":  # SET TRANSACTION: this transaction only
            return []
        # SET SESSION CHARACTERISTICS AS TRANSACTION ... sets default_transaction_*.
        effects = []
        for item in body.get("args", []):
            option = item["DefElem"]
            guc = "default_" + option["defname"]
            value = _constant(option.get("arg"))
            if isinstance(value, int):  # READ ONLY / DEFERRABLE arrive as 1 / 0
                value = "on" if value else "off"
            replay = None if value is None else f"SET {guc} TO {quote_literal(str(value))}"
            effects.append(Effect("pin", "set", guc, replay, True))
        return effects
    if name in _TRANSACTION_SCOPED:
        return []
    # FROM CURRENT copies a value that may itself be transaction-local: not replayable.
    replay = _trim(text) if kind == "VAR_SET_VALUE" else None
    return [Effect("pin", "set", name, replay, True)]


def _temp_relation(relation: _Node) -> list[Effect]:
    if relation.get("relpersistence") == "t" or relation.get("schemaname", "").startswith(
        "pg_temp"
    ):
        return [Effect("pin", "temp_table", relation.get("relname"), None, True)]
    return []


def _drop_effects(body: _Node) -> list[Effect]:
    if body.get("removeType") not in _DROPPABLE:
        return []
    effects = []
    for obj in body.get("objects", []):
        if "List" in obj:
            names = obj["List"].get("items", [])
        elif "ObjectWithArgs" in obj:
            names = obj["ObjectWithArgs"].get("objname", [])
        else:
            continue
        parts = [n["String"]["sval"] for n in names if "String" in n]
        if not parts or (len(parts) > 1 and not parts[-2].startswith("pg_temp")):
            continue  # schema-qualified with a permanent schema: not a temp object
        effects.append(Effect("unpin", "temp_table", parts[-1], None, True))
    return effects


def _explain_executes(body: _Node) -> bool:
    for item in body.get("options", []):
        option = item.get("DefElem", {})
        if option.get("defname") == "analyze":
            return _constant(option.get("arg")) not in (False, 0, "false", "off", "0", "no")
    return False


# -- functions anywhere in a statement ----------------------------------------


def _function_effects(kind: str, body: _Node) -> list[Effect]:
    """Effects of advisory-lock and set_config calls, and of UPDATE pg_settings."""
    effects: list[Effect] = []
    calls = list(_walk_calls(body))
    plain = kind == "SelectStmt" and _is_plain_set_config_select(body)
    for name, args in calls:
        if name in _ADVISORY_LOCK:
            effects.append(Effect("pin", "advisory_lock", None, None, False))
        elif name in _ADVISORY_UNLOCK:
            effects.append(Effect("unpin", "advisory_lock", "one", None, False))
        elif name == "pg_advisory_unlock_all":
            effects.append(Effect("unpin", "advisory_lock", None, None, False))
        elif name == "set_config":
            effect = _set_config_effect(args, plain)
            if effect is not None:
                effects.append(effect)
    if kind == "UpdateStmt":
        effects.extend(_pg_settings_update(body))
    return effects


def _walk_calls(node: Any) -> Iterator[tuple[str, list[Any]]]:
    """Every function call in ``node``, depth-first in source order: (name, args)."""
    stack = [node]
    found: list[tuple[int, str, list[Any]]] = []
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            call = item.get("FuncCall")
            if call is not None:
                names = call.get("funcname", [])
                if names and "String" in names[-1]:
                    found.append(
                        (call.get("location", 0), names[-1]["String"]["sval"], call.get("args", []))
                    )
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    found.sort(key=lambda f: f[0])
    for _, name, args in found:
        yield name, args


def _is_plain_set_config_select(body: _Node) -> bool:
    """``SELECT set_config(...)[, set_config(...)]``: no FROM, WHERE, CTE, set op..."""
    if set(body) - {"targetList", "limitOption", "op"} or body.get("op") != "SETOP_NONE":
        return False
    for target in body.get("targetList", []):
        call = target.get("ResTarget", {}).get("val", {}).get("FuncCall")
        if call is None:
            return False
        names = call.get("funcname", [])
        if names[-1].get("String", {}).get("sval") != "set_config":
            return False
        if len(names) > 1 and names[0].get("String", {}).get("sval") != "pg_catalog":
            return False
    return True


def _set_config_effect(args: list[Any], plain: bool) -> Effect | None:
    consts = [_constant(a) for a in args] if len(args) == 3 else [None, None, None]
    name, value, is_local = consts
    local = _as_bool(is_local)
    if local is True:
        return None  # transaction-local: gone at the end of the transaction
    if not isinstance(name, str):
        return Effect("pin", "set", "set_config", None, True)
    replayable = plain and local is False and isinstance(value, str | int | float)
    replay = (
        f"SELECT pg_catalog.set_config({quote_literal(name)}, {quote_literal(str(value))}, false)"
        if replayable
        else None
    )
    return Effect("pin", "set", name.lower(), replay, True)


def _pg_settings_update(body: _Node) -> list[Effect]:
    """``UPDATE pg_settings SET setting = ... WHERE name = '...'`` is a SET in disguise."""
    relation = body.get("relation", {})
    if relation.get("relname") != "pg_settings" or relation.get("schemaname") not in (
        None,
        "pg_catalog",
    ):
        return []
    where = body.get("whereClause", {}).get("A_Expr", {})
    column = where.get("lexpr", {}).get("ColumnRef", {}).get("fields", [{}])[-1]
    name = _constant(where.get("rexpr"))
    if (
        where.get("kind") == "AEXPR_OP"
        and column.get("String", {}).get("sval") == "name"
        and isinstance(name, str)
    ):
        return [Effect("pin", "set", name.lower(), None, True)]
    return [Effect("pin", "set", "set_config", None, True)]


# -- constants ---------------------------------------------------------------


def _constant(node: Any) -> str | int | float | bool | None:
    """The value of a literal (possibly cast) parse node, or None if not a literal."""
    if not isinstance(node, dict):
        return None
    if "TypeCast" in node:
        return _constant(node["TypeCast"].get("arg"))
    const = node.get("A_Const")
    if const is None:
        return None
    if "sval" in const:
        return str(const["sval"].get("sval", ""))
    if "ival" in const:
        return int(const["ival"].get("ival", 0))
    if "fval" in const:
        return str(const["fval"].get("fval", "0"))
    if "boolval" in const:
        return bool(const["boolval"].get("boolval", False))
    return None  # NULL, bit strings


def _as_bool(value: str | int | float | bool | None) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    return None


def quote_literal(value: str) -> str:
    """A SQL string literal for ``value``, whatever standard_conforming_strings says."""
    if "\\" in value:
        return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    return "'" + value.replace("'", "''") + "'"


def quote_identifier(name: str) -> str:
    """A quoted SQL identifier for ``name`` (a setting's name, in RESET)."""
    return '"' + name.replace('"', '""') + '"'


# -- fallback for texts pglast cannot parse ----------------------------------
_FALLBACK_PIN_KEYWORDS = frozenset({"SET", "PREPARE", "DECLARE", "LISTEN", "LOAD"})
_FALLBACK_NOT_SESSION = {
    "SET": frozenset({"LOCAL", "TRANSACTION", "CONSTRAINTS"}),
    "PREPARE": frozenset({"TRANSACTION"}),
}
_RISKY_NAMES = ("advisory", "set_config", "pg_settings")
_INTO_OK_TOKENS = frozenset(word.upper() for word in _INTO_OK)


def _fallback(sql: str) -> tuple[Effect, ...]:
    """Token-level guess for a text the grammar rejected (see the module docstring)."""
    try:
        tokens = [t for t in scan(sql) if t.name not in _COMMENT_TOKENS]
    except ParseError:
        return NO_EFFECTS  # not even lexically valid: the server cannot run it either
    effects: list[Effect] = []
    statement: list[Any] = []
    for token in [*tokens, None]:
        if token is not None and token.name != "ASCII_59":
            statement.append(token)
            continue
        if statement:
            reason = _fallback_reason(sql, statement)
            if reason is not None:
                effects.append(Effect("pin", "session_other", reason, None, False))
        statement = []
    return tuple(effects)


def _fallback_reason(sql: str, tokens: list[Any]) -> str | None:
    """Why an unparseable statement might create session state (None: it cannot).

    Deliberately no broader than what the fast path declines, so that the
    fast path's "stateless" never contradicts this guess.
    """
    first: str = tokens[0].name
    second = tokens[1].name if len(tokens) > 1 else ""
    if first in _FALLBACK_PIN_KEYWORDS and second not in _FALLBACK_NOT_SESSION.get(
        first, frozenset()
    ):
        return "unparsed " + first.lower()
    words = [sql[t.start : t.end + 1].lower() for t in tokens if t.name == "IDENT"]
    temp = bool({t.name for t in tokens} & {"TEMP", "TEMPORARY"}) or any(
        w.strip('"').startswith("pg_temp") for w in words
    )
    if temp and first == "CREATE":
        return "unparsed create temp"
    if temp and first not in _INTO_OK_TOKENS and any(t.name == "INTO" for t in tokens):
        return "unparsed into temp"
    for token in tokens:
        if token.name == "UIDENT":
            return "unparsed u&identifier"
    for word in words:
        if any(risky in word for risky in _RISKY_NAMES):
            return "unparsed " + word.strip('"')
    return None
