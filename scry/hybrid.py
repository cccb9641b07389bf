"""Hybrid pooling: follow each client's session state and decide when it pins.

A ``SessionTracker`` per client (transaction and hybrid modes) is fed by the
relay: every Query text and every Parse text is classified
(``scry.protocol.classify``, a regex fast path that proves most texts
stateless without parsing); texts that change session state are queued with
the ordinal of the ReadyForQuery that will complete them. When that
ReadyForQuery arrives (``settle``), their effects are applied to the client's
``SessionState`` only if the statement succeeded, with COMMIT/ROLLBACK
deciding the fate of changes made inside a transaction block.

* hybrid: a client holding session state is *pinned*: its server is not
  given back between transactions. State that is only SETs and SQL PREPAREs
  is *replayable*: after ``pool.idle_unpin_seconds`` of idleness the server
  is reset and released, and the recorded statements are replayed on the next
  server before the client's next query.
* transaction: nothing pins (PgBouncer's behaviour); the first statement that
  leaves session state is logged once per client, naming the statement kind.
  While the observatory runs, that check is its drain's, off the query path
  (``TransactionTracker``): the relay then only looks for DISCARD and
  DEALLOCATE, whose effect on the server scry must know.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from scry.log import event
from scry.protocol.classify import Effect, classify, classify_bytes
from scry.protocol.session_state import SessionState
from scry.protocol.string_escapes import standard_text

if TYPE_CHECKING:
    from scry.server import ServerConnection

_TX_IDLE = ord("I")

# Settings PostgreSQL reports with ParameterStatus: scry follows them for every
# client and re-applies them on whichever server serves it, so they never pin.
FOLLOWED_SETTINGS = frozenset(
    {
        "application_name",
        "client_encoding",
        "datestyle",
        "intervalstyle",
        "timezone",
        "standard_conforming_strings",
    }
)


def unfollowed(effects: tuple[Effect, ...]) -> tuple[Effect, ...]:
    return tuple(e for e in effects if not (e.reason == "set" and e.key in FOLLOWED_SETTINGS))


class SessionTracker:
    """Session state of one client, and what is still to be settled."""

    __slots__ = (
        "client_id",
        "pinning",
        "_state",
        "queued",
        "work",
        "pinned_since",
        "needs_replay",
        "_parse_effects",
        "_warned",
        "nonstandard_strings",
    )

    def __init__(self, client_id: str, pinning: bool = False) -> None:
        self.client_id = client_id
        self.pinning = pinning  # hybrid: pin; transaction: only warn
        self._state: SessionState | None = None  # created with the first effect
        # (ordinal of the completing ReadyForQuery, effects, statement text).
        # A list: nearly always empty, and an empty deque costs a 0.5 kB block.
        self.queued: list[tuple[int, tuple[Effect, ...], bytes]] = []
        self.work = False  # anything for settle() to do: checked per ReadyForQuery
        self.pinned_since = 0.0
        self.needs_replay = False  # server reclaimed: replay before the next query
        self._parse_effects: tuple[tuple[Effect, ...], bytes] | None = None
        self._warned = False
        # standard_conforming_strings is off: texts are read through
        # standard_text first (the client keeps this up to date).
        self.nonstandard_strings = False

    @property
    def state(self) -> SessionState:
        state = self._state
        if state is None:
            state = self._state = SessionState()
        return state

    @property
    def pinned(self) -> bool:
        return self.pinning and self._state is not None and self._state.pinned

    # --- fed by the client relay -------------------------------------------------

    def on_query(self, body: bytes, ordinal: int) -> None:
        """A Query message, completed by ReadyForQuery number ``ordinal``."""
        if self.nonstandard_strings:
            body = standard_text(body)
        effects = classify_bytes(body)
        if effects and (effects := unfollowed(effects)):
            self.queued.append((ordinal, effects, body))
            self.work = True

    def on_parse(self, text: bytes) -> None:
        """A Parse message: its effects land with the next Sync."""
        if self.nonstandard_strings:
            text = standard_text(text)
        effects = unfollowed(classify(text.decode("utf-8", "replace")))
        self._parse_effects = (effects, text) if effects else None

    def on_sync(self, ordinal: int) -> None:
        pending = self._parse_effects
        if pending is not None:
            self._parse_effects = None
            self.queued.append((ordinal, pending[0], pending[1]))
            self.work = True

    def never_ran(self, answered: int) -> None:
        """The requests up to ReadyForQuery number ``answered`` were refused
        before any server saw them (the breaker): their effects never happened."""
        self.queued = [entry for entry in self.queued if entry[0] > answered]
        self.work = bool(self.queued) or self.state.tentative

    # --- fed by the server relay ----------------------------------------------------

    def settle(
        self,
        answered: int,
        sqlstate: str | None,
        status: int,
        server: ServerConnection,
        now: float,
    ) -> None:
        """ReadyForQuery number ``answered`` arrived (``status`` is its transaction status)."""
        state = self.state
        was_pinned = self.pinned and not state.tentative
        if state.tentative and status == _TX_IDLE:
            # A transaction block ended: COMMIT keeps its changes, anything else drops them.
            if server.last_tag.startswith(b"COMMIT"):
                state.commit()
            else:
                state.rollback()
        queued = self.queued
        while queued and queued[0][0] <= answered:
            ordinal, effects, text = queued.pop(0)
            if ordinal < answered:
                continue  # its ReadyForQuery was never seen (server lost); stale
            statement = text.rstrip(b"\x00").decode("utf-8", "replace")
            if sqlstate is not None:
                state.apply_failed(effects, statement)
                if _resets_server(effects):
                    # DEALLOCATE is not transactional, and the error may have come
                    # before it or after: what the server holds is unknown now.
                    server.retire_because("a failed query held DISCARD or DEALLOCATE")
            else:
                state.apply(effects, in_transaction=status != _TX_IDLE, statement=statement)
                self._server_side_effects(effects, server)
            self._note(statement, now)
        self.work = bool(queued) or state.tentative
        if not was_pinned and self.pinned and not state.tentative:
            server.proxy.observatory.metrics.count_pin(state.reasons())

    def _server_side_effects(self, effects: tuple[Effect, ...], server: ServerConnection) -> None:
        if _resets_server(effects):
            # DISCARD ALL / DEALLOCATE ALL also dropped scry's own statements.
            server.statements.forget_all()
        if any(effect.op == "unpin_all" for effect in effects):
            server.applied = {}

    def _note(self, statement: str, now: float) -> None:
        pinned = self.state.pinned
        if self.pinning:
            if pinned and not self.pinned_since:
                self.pinned_since = now
            elif not pinned:
                self.pinned_since = 0.0
            return
        if pinned:
            self.warn(self.state.reasons())
            self.state.clear()

    def warn(self, reasons: Iterable[str]) -> None:
        """Transaction pooling: say once that this client leaves session state."""
        if not self._warned:
            self._warned = True
            event("session state in transaction pooling: it may leak to other clients",
                  logging.WARNING, client=self.client_id, kinds=", ".join(reasons),
                  hint="use pool.mode hybrid or session")  # fmt: skip

    # --- replay -----------------------------------------------------------------------

    def reasons(self) -> tuple[str, ...] | None:
        return self.state.reasons() if self.pinned else None

    def replay_sql(self) -> str:
        return ";".join(self.state.replay_statements())


def _resets_server(effects: tuple[Effect, ...]) -> bool:
    """DISCARD ALL or DEALLOCATE ALL among ``effects`` (scry's own statements go too)."""
    return any(e.op == "unpin_all" or (e.reason == "prepare" and e.key is None) for e in effects)


# The statements whose effect on the server itself scry must follow: DISCARD
# ALL (settings and prepared statements gone) and DEALLOCATE [ALL].
_SERVER_RESETS = re.compile(rb"(?i)discard|deallocate")


class TransactionTracker(SessionTracker):
    """Transaction mode while the observatory runs.

    The relay classifies only texts that may hold DISCARD or DEALLOCATE (a
    regex, a third of a classification); the warning about other session
    state comes from the observatory's drain, which classifies each query
    shape once and calls :meth:`warn` (see ``Proxy._session_state_seen``).
    """

    __slots__ = ()

    # (No __init__ of its own: SessionTracker's with pinning off; one frame
    # less for every login in transaction mode.)

    def on_query(self, body: bytes, ordinal: int) -> None:
        if _SERVER_RESETS.search(body) is not None:
            SessionTracker.on_query(self, body, ordinal)

    def on_parse(self, text: bytes) -> None:
        if _SERVER_RESETS.search(text) is not None:
            SessionTracker.on_parse(self, text)
        else:
            self._parse_effects = None
