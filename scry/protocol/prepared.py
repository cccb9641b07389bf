"""Protocol-level prepared statements across pooled servers, without I/O.

In transaction and hybrid pooling a client's next transaction may run on
another server, where its named prepared statements do not exist. As
PgBouncer's ``max_prepared_statements`` does, scry keeps each client's
statements itself and gives every distinct statement (query text plus
parameter types) one server-side name, ``scry_<hash>``, prepared on demand on
whichever server serves the client and kept there in an LRU:

* ``Parse(name)``: remembered for the client and prepared under its
  server-side name. If the server already has that statement it is closed
  first, so a client's Parse always plans afresh (as it would on PostgreSQL
  directly: a changed table never leaves a stale plan behind) and the client
  gets its own ParseComplete, or its own parse error.
* ``Bind``/``Describe`` of a named statement: renamed; if the server lacks the
  statement, a Parse is inserted first and its ParseComplete is dropped from
  the response stream.
* ``Close`` of a named statement: forgotten for the client; the server-side
  statement stays for other clients. The Close is sent for a name that never
  exists, which PostgreSQL answers with CloseComplete.
* A batch of nothing but named Parses and a Sync (libpq's ``PQprepare``), sent
  while no server is free, of statements the pool has parsed before: answered
  by scry (:func:`answer_prepare`), and each Parse is sent, afresh as above, in
  front of the statement's first Bind or Describe. A client never waits for a
  server only to learn that a known statement parses. (pgbench ``-M prepared
  -j 1`` drives all its connections from one thread and blocks in
  ``PQprepare``: when the connections it has not yet driven hold every
  server in their transactions, a pooler that waits for a server deadlocks.)

Responses: every Parse and Close sent is recorded in order (``expect``);
ParseComplete/CloseComplete from the server pop that record, and the ones
scry caused are dropped. After an ErrorResponse PostgreSQL skips everything
up to the next Sync, so the records of that Sync segment are discarded.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import NamedTuple

from scry.protocol import messages as m
from scry.protocol.errors import ProtocolViolation

_P = m.PARSE[0]
_B = m.BIND[0]
_D = m.DESCRIBE[0]
_C = m.CLOSE[0]
_SYNC = m.SYNC[0]
_Q = m.QUERY[0]
_F = m.FUNCTION_CALL[0]
PARSE_COMPLETE = m.PARSE_COMPLETE[0]
CLOSE_COMPLETE = m.CLOSE_COMPLETE[0]
_STATEMENT = ord("S")
_NEVER_EXISTS = b"scry_closed"  # Close of a name that does not exist: CloseComplete
_HEADER = struct.Struct("!cI")


def _msg(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(bytes((kind,)), len(body) + 4) + body


def server_name(parse_rest: bytes) -> bytes:
    """The server-side name of a statement: a hash of its text and parameter types."""
    return b"scry_" + hashlib.blake2b(parse_rest, digest_size=10).hexdigest().encode()


class ParsedStatements:
    """Server-side names a pool's servers have parsed without error (an LRU)."""

    __slots__ = ("capacity", "names")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.names: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, sname: bytes) -> bool:
        return sname in self.names

    def add(self, sname: bytes) -> None:
        names = self.names
        names[sname] = None
        names.move_to_end(sname)
        if len(names) > self.capacity:
            names.popitem(last=False)


class Expected(NamedTuple):
    kind: int  # PARSE_COMPLETE or CLOSE_COMPLETE
    drop: bool  # caused by scry, not by the client: do not forward
    segment: int  # Sync segment the request belongs to
    name: bytes | None = None  # the server-side statement it creates or closes


class ServerStatements:
    """The prepared statements one backend holds, and the responses owed for them."""

    __slots__ = (
        "capacity",
        "names",
        "uncertain",
        "expect",
        "segments_sent",
        "segments_done",
        "unnamed_owner",
        "parses_sent",
        "parsed",
    )

    def __init__(self, capacity: int, parsed: ParsedStatements | None = None) -> None:
        self.capacity = max(1, capacity)
        # The pool's record of statements that parse (see answer_prepare).
        self.parsed = parsed if parsed is not None else ParsedStatements(capacity)
        self.names: OrderedDict[bytes, None] = OrderedDict()
        # Names whose Parse or Close PostgreSQL skipped after an error: they may or
        # may not exist, so the next Parse of one closes it first (harmless if absent).
        self.uncertain: set[bytes] = set()
        self.expect: deque[Expected] = deque()
        # Sync/Query/FunctionCall messages sent and ReadyForQuery received, ever;
        # equal whenever the server is idle, so links need no reset.
        self.segments_sent = 0
        self.segments_done = 0
        # Whose unnamed statement this backend holds (a ClientStatements), if known.
        self.unnamed_owner: object | None = None
        self.parses_sent = 0  # named statements rewriting prepared on the backend, ever

    def forget_all(self) -> None:
        """DISCARD ALL / DEALLOCATE ALL ran: the backend has no statements left."""
        self.names.clear()
        self.uncertain.clear()
        self.unnamed_owner = None

    def on_response(self, kind: int) -> bool:
        """ParseComplete or CloseComplete arrived: True if the client must not see it."""
        expect = self.expect
        if expect and expect[0].kind == kind:
            expected = expect.popleft()
            if kind == PARSE_COMPLETE and expected.name is not None:
                self.parsed.add(expected.name)
            return expected.drop
        return False

    def on_error(self) -> None:
        """ErrorResponse: PostgreSQL skips the rest of this Sync segment."""
        expect = self.expect
        segment = self.segments_done
        while expect and expect[0].segment == segment:
            self._skipped(expect.popleft())

    def on_ready(self) -> None:
        """After ``segments_done`` was advanced for a ReadyForQuery."""
        # Anything still recorded for a finished segment was skipped.
        expect = self.expect
        while expect and expect[0].segment < self.segments_done:
            self._skipped(expect.popleft())

    def _skipped(self, expected: Expected) -> None:
        name = expected.name
        if name is not None:
            self.names.pop(name, None)
            self.uncertain.add(name)


class ClientStatements:
    """A client's named prepared statements: client name -> (server name, Parse body rest).

    ``unnamed`` is the rest of its last unnamed Parse: a client may parse the
    unnamed statement, Sync, and bind it later (pg8000 does), by which time it
    may be on another server; it is then parsed there again first.
    ``deferred`` holds the names whose Parse scry answered itself
    (:func:`answer_prepare`) and no server has seen yet.
    """

    __slots__ = ("by_name", "unnamed", "deferred")

    def __init__(self) -> None:
        self.by_name: dict[bytes, tuple[bytes, bytes]] = {}
        self.unnamed: bytes | None = None
        self.deferred: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.by_name)


def uses_named_statement(kind: int, body: bytes) -> bool:
    """Does this client message refer to a named prepared statement?"""
    if kind == _P:
        return body[:1] != b"\x00"
    if kind == _B:
        portal_end = body.index(b"\x00")
        return body[portal_end + 1 : portal_end + 2] != b"\x00"
    if kind in (_D, _C):
        return body[:1] == b"S" and body[1:2] != b"\x00"
    return False


def answer_prepare(
    messages: list[tuple[int, bytes]], client: ClientStatements, parsed: ParsedStatements
) -> bytes | None:
    """What a server would answer to a batch of named Parses and a Sync, if every
    statement in it is one the pool has parsed; else None (the batch needs a server).

    Outside a transaction, with no server, only: the answer says idle. Each Parse
    is remembered for the client and deferred to its first Bind or Describe.
    """
    if len(messages) < 2 or messages[-1][0] != _SYNC:
        return None
    statements = []
    for kind, body in messages[:-1]:
        if kind != _P or body[:1] == b"\x00":
            return None
        nul = body.find(b"\x00")
        if nul < 0:
            return None  # malformed: the server path reports it
        rest = body[nul + 1 :]
        sname = server_name(rest)
        if sname not in parsed:
            return None
        statements.append((body[:nul], sname, rest))
    for name, sname, rest in statements:
        client.by_name[name] = (sname, rest)
        client.deferred.add(name)
    return _msg(PARSE_COMPLETE, b"") * len(statements) + m.ready_for_query()


def rewrite(
    messages: list[tuple[int, bytes]], client: ClientStatements, server: ServerStatements
) -> bytes:
    """Rewrite a batch of whole client messages for ``server``; returns the bytes to send.

    Raises ProtocolViolation for a message whose body lacks its fields.
    """
    try:
        return _rewrite(messages, client, server)
    except (ValueError, IndexError) as exc:
        raise ProtocolViolation("malformed extended-protocol message") from exc


def _rewrite(
    messages: list[tuple[int, bytes]], client: ClientStatements, server: ServerStatements
) -> bytes:
    out: list[bytes] = []
    expect = server.expect
    # The caller adds the batch's Sync/Query/FunctionCall count to
    # ``segments_sent`` after sending; here it only numbers the records.
    segment = server.segments_sent
    for kind, body in messages:
        if kind == _P:
            nul = body.index(b"\x00")
            name, rest = body[:nul], body[nul + 1 :]
            if not name:
                client.unnamed = rest
                server.unnamed_owner = client
                expect.append(Expected(PARSE_COMPLETE, False, segment))
                out.append(_msg(kind, body))
                continue
            sname = server_name(rest)
            client.by_name[name] = (sname, rest)
            if client.deferred:
                client.deferred.discard(name)
            _parse_afresh(out, server, sname, rest, False, segment)
        elif kind == _B:
            portal_end = body.index(b"\x00")
            stmt_end = body.index(b"\x00", portal_end + 1)
            name = body[portal_end + 1 : stmt_end]
            if not name:
                _ensure_unnamed(out, client, server, segment)
            known = client.by_name.get(name) if name else None
            if known is None:
                out.append(_msg(kind, body))
                continue
            sname = _ensure(out, client, server, name, known, segment)
            out.append(_msg(_B, body[: portal_end + 1] + sname + body[stmt_end:]))
        elif kind in (_D, _C):
            name = body[1:-1]
            if kind == _D and body[0] == _STATEMENT and not name:
                _ensure_unnamed(out, client, server, segment)
            if body[0] != _STATEMENT or not name or name not in client.by_name:
                if kind == _C:
                    expect.append(Expected(CLOSE_COMPLETE, False, segment))
                out.append(_msg(kind, body))
                continue
            if kind == _D:
                sname = _ensure(out, client, server, name, client.by_name[name], segment)
                out.append(_msg(_D, b"S" + sname + b"\x00"))
            else:
                del client.by_name[name]
                client.deferred.discard(name)
                expect.append(Expected(CLOSE_COMPLETE, False, segment))
                out.append(_msg(_C, b"S" + _NEVER_EXISTS + b"\x00"))
        else:
            if kind in (_SYNC, _Q, _F):
                segment += 1
                if kind == _Q:  # a simple Query replaces the unnamed statement
                    client.unnamed = None
                    server.unnamed_owner = None
            out.append(_msg(kind, body))
    return b"".join(out)


def _ensure_unnamed(
    out: list[bytes], client: ClientStatements, server: ServerStatements, segment: int
) -> None:
    """Before a Bind/Describe of the unnamed statement: make sure it is the client's."""
    if server.unnamed_owner is client or client.unnamed is None:
        return
    server.unnamed_owner = client
    server.expect.append(Expected(PARSE_COMPLETE, True, segment))
    out.append(_msg(_P, b"\x00" + client.unnamed))


def _ensure(
    out: list[bytes],
    client: ClientStatements,
    server: ServerStatements,
    name: bytes,
    known: tuple[bytes, bytes],
    segment: int,
) -> bytes:
    sname, rest = known
    if client.deferred and name in client.deferred:
        # The client's own Parse, answered by scry: parsed now, as it would have been.
        client.deferred.discard(name)
        _parse_afresh(out, server, sname, rest, True, segment)
    elif sname in server.names:
        server.names.move_to_end(sname)
    else:
        _prepare(out, server, sname, rest, True, segment)
    return sname


def _parse_afresh(
    out: list[bytes], server: ServerStatements, sname: bytes, rest: bytes, drop: bool, segment: int
) -> None:
    """A client's Parse: plans anew even where the server holds the statement."""
    if sname in server.names:
        del server.names[sname]
        server.expect.append(Expected(CLOSE_COMPLETE, True, segment, sname))
        out.append(_msg(_C, b"S" + sname + b"\x00"))
    _prepare(out, server, sname, rest, drop, segment)


def _prepare(
    out: list[bytes], server: ServerStatements, sname: bytes, rest: bytes, drop: bool, segment: int
) -> None:
    names = server.names
    while len(names) >= server.capacity:
        evicted, _ = names.popitem(last=False)
        server.expect.append(Expected(CLOSE_COMPLETE, True, segment, evicted))
        out.append(_msg(_C, b"S" + evicted + b"\x00"))
    if sname in server.uncertain:
        server.uncertain.discard(sname)
        server.expect.append(Expected(CLOSE_COMPLETE, True, segment, sname))
        out.append(_msg(_C, b"S" + sname + b"\x00"))
    names[sname] = None
    server.parses_sent += 1
    server.expect.append(Expected(PARSE_COMPLETE, drop, segment, sname))
    out.append(_msg(_P, sname + b"\x00" + rest))
