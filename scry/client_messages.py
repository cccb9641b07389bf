"""The relay's whole-message mode: named prepared statements under transaction pooling.

A client that names a prepared statement while its server can change hands
(transaction or hybrid pooling) can no longer be relayed chunk by chunk: each
Parse/Bind/Describe/Close naming a statement is rewritten for whichever server
runs it (:mod:`scry.protocol.prepared`). ``MessageModeRelay`` is that half of
:class:`scry.client.ClientConnection` (a mixin): from the first named Parse on,
the client's bytes are read as whole messages, tracked for capture and pinning
as in the scanning relay, and rendered per server when sent.
"""

from __future__ import annotations

from time import monotonic

from scry.protocol import messages as m
from scry.protocol.errors import PROTOCOL_VIOLATION, ProtocolViolation
from scry.protocol.framing import MessageReader
from scry.protocol.prepared import ClientStatements, answer_prepare
from scry.protocol.prepared import rewrite as rewrite_statements
from scry.server import REC_EXECUTE, REC_QUERY, REC_SYNC, ServerConnection

_Q = m.QUERY[0]
_SYNC = m.SYNC[0]
_F = m.FUNCTION_CALL[0]
_X = m.TERMINATE[0]
_EXECUTE = m.EXECUTE[0]
_PARSE = m.PARSE[0]
_BIND = m.BIND[0]
_COPY_DONE = m.COPY_DONE[0]
_COPY_FAIL = m.COPY_FAIL[0]
_EXTENDED = frozenset(x[0] for x in (m.PARSE, m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH, m.EXECUTE))
# Capture markers (see REC_* in scry.server): a Sync, and a FunctionCall's "text".
SYNC_MARK = (REC_SYNC, b"")
FUNCTION_CALL_MARK = (REC_QUERY, b"<function call>")


def parse_text(body: bytes) -> bytes:
    """The query text of a Parse message body (statement name NUL query NUL ...)."""
    start = body.find(b"\x00") + 1
    return body[start : body.find(b"\x00", start)]


class MessageModeRelay:
    """Whole-message relay with statement rewriting, for a ClientConnection."""

    __slots__ = ()  # the attributes are ClientConnection's

    def _enter_message_mode(self) -> None:
        """Read whole messages from now on, so statements can be rewritten."""
        self._messages = MessageReader(self.proxy.config.max_packet_size)
        statements = self.statements = ClientStatements()
        statements.unnamed = self._unnamed_rest
        self._unnamed_text = self._last_text
        if self.server is not None and self._unnamed_rest is not None:
            self.server.statements.unnamed_owner = statements

    @property
    def message_mode(self) -> bool:
        return self._messages is not None

    def _render(self, messages: list[tuple[int, bytes]], server: ServerConnection) -> bytes:
        assert self.statements is not None
        before = server.statements.parses_sent
        try:
            data = rewrite_statements(messages, self.statements, server.statements)
        except ProtocolViolation as exc:
            server.desynced = True  # earlier batches went to it; this one is dropped
            self.fatal(exc.sqlstate, str(exc))
            return b""
        self.stats.server_parse_count += server.statements.parses_sent - before
        return data

    def _answer_prepare(self) -> bool:
        """No server is free and all the client asked is to prepare statements the
        pool has parsed before: answer it here (see scry.protocol.prepared)."""
        queue = self._queue
        if len(queue) != 1 or self._queued_owed != 1 or self._paused_waiting:
            return False
        messages = queue[0][0]
        if messages.__class__ is bytes:
            return False
        tracker = self.tracker
        if tracker is not None and tracker.work:
            return False  # session state waits on this ReadyForQuery
        inflight = self.inflight
        if inflight and (len(inflight) != 1 or inflight[0][0] != REC_SYNC):
            return False
        assert self.statements is not None and self.pool is not None
        answer = answer_prepare(messages, self.statements, self.pool.parsed_statements)
        if answer is None:
            return False
        inflight.clear()
        self._queue = []
        self._queued_owed = self._queued_bytes = 0
        self.answered += 1
        self.transport.write(answer)
        return True

    def _start_rewriting(
        self, out: bytes, parse_start: int, owed: int, texts: list[tuple[int, bytes]] | None
    ) -> bool:
        """The client named a prepared statement: switch to whole-message rewriting.

        Everything before the Parse is forwarded as scanned; the Parse and what
        follows is re-read as whole messages. Returns False (keep scanning) in the
        rare case the Parse body was truncated by the scanner and cannot be located.
        """
        if parse_start < 0:
            return False
        head, tail = out[:parse_start], out[parse_start:] + self._scanner.detach()
        self._enter_message_mode()
        self.ordinal += owed
        if texts:
            self._note_inflight(texts)
        if head:
            self._forward(head, owed, len(head))
        self._relay_messages(tail)
        return True

    def _relay_messages(self, data: bytes) -> None:
        reader = self._messages
        assert reader is not None
        reader.feed(data)
        try:
            messages = reader.messages()
        except ProtocolViolation as exc:
            self.refuse_stream(exc)
            return
        if not messages:
            return
        if self.refuse_query and any(kind == _Q for kind, _ in messages):
            self._refuse_simple_query()
            return
        owed = 0
        terminate = False
        size = 0
        texts: list[tuple[int, bytes]] | None = [] if self.observed else None
        tracker = self.tracker
        self.last_active = monotonic()
        chain = False  # the last message was a Query/Execute, or a Sync right after one
        try:
            for index, (kind, body) in enumerate(messages):
                adjacent, chain = chain, False
                if kind in _EXTENDED:
                    self._unsynced = True
                if kind == _SYNC:
                    owed += 1
                    self._syncs_since_execute += 1
                    if adjacent:  # (a COPY it starts ignores this Sync: see scry.server)
                        chain = True
                        self._early_syncs += 1
                    self._unsynced = False
                    if texts is not None:
                        texts.append(SYNC_MARK)
                    if tracker is not None:
                        tracker.on_sync(self.ordinal + owed)
                elif kind in (_Q, _F):
                    owed += 1
                    self._syncs_since_execute = self._early_syncs = 0
                    chain = kind == _Q
                    self._unnamed_open = False
                    if texts is not None:
                        texts.append((REC_QUERY, body) if kind == _Q else FUNCTION_CALL_MARK)
                    if tracker is not None and kind == _Q:
                        tracker.on_query(body, self.ordinal + owed)
                elif kind == _EXECUTE:
                    self._syncs_since_execute = self._early_syncs = 0
                    chain = True
                    self._unnamed_open = False
                    if texts is not None:
                        texts.append((REC_EXECUTE, self._last_text))
                elif kind == _PARSE:
                    text = parse_text(body)
                    if body[:1] == b"\x00":
                        self._unnamed_open = True
                        self._unnamed_text = text
                        if tracker is not None:
                            # Named statements run their text at each Execute; protocol-level
                            # prepares are tracked by scry itself and never pin.
                            tracker.on_parse(text)
                    else:  # SHOW STATS counts named statements only, as PgBouncer
                        self.stats.client_parse_count += 1
                        if texts is not None:
                            self._named_texts[body[: body.index(b"\x00")]] = text
                elif kind == _BIND:
                    if body[body.index(b"\x00") + 1] != 0:  # a named statement
                        self.stats.bind_count += 1
                    if texts is not None:
                        self._last_text = self._bound_text(body)
                elif kind == _X:
                    del messages[index:]
                    terminate = True
                    self.stats.received -= 5  # PgBouncer does not count the Terminate
                    break
                elif kind in (_COPY_DONE, _COPY_FAIL):
                    self._close_copy_window()
                size += len(body) + 5
        except (ValueError, IndexError):  # a body cut short of its fields
            self.fatal(PROTOCOL_VIOLATION, "malformed extended-protocol message")
            return
        self.ordinal += owed
        if texts:
            self._note_inflight(texts)
        if messages:
            self._forward(messages, owed, size)
        if terminate:
            self._cleanup("client closed")

    def _bound_text(self, bind_body: bytes) -> bytes:
        """The statement text behind a Bind (the last Parse's, for the unnamed statement)."""
        portal_end = bind_body.index(b"\x00")
        name = bind_body[portal_end + 1 : bind_body.index(b"\x00", portal_end + 1)]
        if name:
            return self._named_texts.get(name, b"")
        return self._unnamed_text
