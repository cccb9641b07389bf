"""Per-client session-state tracker for the hybrid pool mode.

The proxy feeds it the :class:`~scry.protocol.classify.Effect` s of every
statement text the server ran successfully and asks one question per
transaction end: ``pinned`` -- may this client's server go back to the pool?

Transactions: effects applied while a transaction block is open are
tentative. ``commit()`` keeps them; ``rollback()`` undoes the transactional
ones (SET, temp tables, WITH HOLD cursors, LISTEN, DROP/RESET/UNLISTEN) and
keeps the rest (PREPARE/DEALLOCATE, CLOSE, advisory locks, LOAD), exactly as
PostgreSQL does. How the proxy drives this from the wire (CommandComplete
tags, ReadyForQuery status) is described in docs/hybrid.md.

Replay: a client pinned only by SET and PREPARE state can be moved to a fresh
server by running :meth:`SessionState.replay_statements` there first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scry.protocol.classify import Effect, Reason

__all__ = ["SessionState"]

# GUCs RESET ALL leaves alone (GUC_NO_RESET_ALL in PostgreSQL's guc_tables.c).
_NO_RESET_ALL = frozenset({"role", "session_authorization"})
_REPLAYABLE_REASONS = frozenset({"set", "prepare"})


class _State:
    """The session state proper; copied once per transaction that changes it."""

    __slots__ = (
        "advisory_locks",
        "cursors",
        "first_pins",
        "listen",
        "other",
        "prepared",
        "settings",
        "temp",
    )

    def __init__(self) -> None:
        self.settings: dict[str, str | None] = {}  # name -> replay SQL (None: not replayable)
        self.prepared: dict[str, str | None] = {}  # name -> PREPARE text
        self.temp: set[str] = set()
        self.cursors: set[str] = set()
        self.listen: set[str] = set()
        self.advisory_locks = 0
        self.other: dict[str, set[str]] = {}  # load / session_other -> keys
        self.first_pins: dict[str, str] = {}  # reason -> statement that first pinned it

    def clear(self) -> None:
        self.settings.clear()
        self.prepared.clear()
        self.temp.clear()
        self.cursors.clear()
        self.listen.clear()
        self.advisory_locks = 0
        self.other.clear()
        self.first_pins.clear()

    def copy(self) -> _State:
        twin = _State()
        twin.settings = dict(self.settings)
        twin.prepared = dict(self.prepared)
        twin.temp = set(self.temp)
        twin.cursors = set(self.cursors)
        twin.listen = set(self.listen)
        twin.advisory_locks = self.advisory_locks
        twin.other = {reason: set(keys) for reason, keys in self.other.items()}
        twin.first_pins = dict(self.first_pins)
        return twin

    def reasons(self) -> tuple[str, ...]:
        present = [
            reason
            for reason, held in (
                ("set", self.settings),
                ("prepare", self.prepared),
                ("temp_table", self.temp),
                ("cursor", self.cursors),
                ("advisory_lock", self.advisory_locks),
                ("listen", self.listen),
            )
            if held
        ]
        present.extend(reason for reason, keys in self.other.items() if keys)
        return tuple(sorted(present))

    def apply(self, effect: Effect, statement: str | None) -> None:
        op, reason, key, replay, _ = effect
        if op == "unpin_all":  # DISCARD ALL
            self.clear()
            return
        if op == "pin":
            self._pin(reason, key, replay)
            if reason not in self.first_pins:
                self.first_pins[reason] = statement or replay or _describe_pin(effect)
        else:
            self._unpin(reason, key)

    def _pin(self, reason: Reason, key: str | None, replay: str | None) -> None:
        name = key or ""
        if reason == "set":
            self.settings.pop(name, None)  # re-setting moves it last: replay keeps the order
            self.settings[name] = replay
        elif reason == "prepare":
            self.prepared[name] = replay
        elif reason == "temp_table":
            self.temp.add(name)
        elif reason == "cursor":
            self.cursors.add(name)
        elif reason == "advisory_lock":
            self.advisory_locks += 1
        elif reason == "listen":
            self.listen.add(name)
        else:
            self.other.setdefault(reason, set()).add(name)

    def _unpin(self, reason: Reason, key: str | None) -> None:
        if reason == "set":
            if key is None:  # RESET ALL
                for name in [n for n in self.settings if n not in _NO_RESET_ALL]:
                    del self.settings[name]
            else:
                self.settings.pop(key, None)
        elif reason == "prepare":
            _discard(self.prepared, key)
        elif reason == "temp_table":
            _discard(self.temp, key)
        elif reason == "cursor":
            _discard(self.cursors, key)
        elif reason == "listen":
            _discard(self.listen, key)
        elif reason == "advisory_lock":
            # key "one": pg_advisory_unlock; None: pg_advisory_unlock_all.
            self.advisory_locks = max(0, self.advisory_locks - 1) if key else 0
        elif reason in self.other:
            _discard(self.other[reason], key)
        for gone in [r for r in self.first_pins if r not in self.reasons()]:
            del self.first_pins[gone]


def _discard(container: dict[str, str | None] | set[str], key: str | None) -> None:
    if key is None:
        container.clear()
    elif isinstance(container, dict):
        container.pop(key, None)
    else:
        container.discard(key)


def _describe_pin(effect: Effect) -> str:
    return f"{effect.reason} {effect.key}" if effect.key else effect.reason


class SessionState:
    """What session state a client has created on its server, and whether it can move.

    ``pinned`` is a plain attribute, kept current by every mutation, so the
    proxy's per-transaction check costs one attribute read.
    """

    __slots__ = ("_nontransactional", "_snapshot", "_state", "pinned")

    def __init__(self) -> None:
        self._state = _State()
        self._snapshot: _State | None = None  # state before the open transaction changed it
        self._nontransactional: list[tuple[Effect, str | None]] = []  # replayed after rollback
        self.pinned = False

    # -- feeding -----------------------------------------------------------

    def apply(
        self, effects: Sequence[Effect], in_transaction: bool, statement: str | None = None
    ) -> None:
        """Record the effects of a statement text the server completed successfully.

        ``in_transaction``: a transaction block is still open afterwards, so the
        transactional effects are tentative until :meth:`commit` / :meth:`rollback`.
        ``statement`` is the text that caused them, kept for :meth:`pin_statement`.
        """
        if not effects:
            return
        if in_transaction and self._snapshot is None:
            self._snapshot = self._state.copy()
        for effect in effects:
            self._state.apply(effect, statement)
            if in_transaction and not effect.transactional:
                self._nontransactional.append((effect, statement))
        self.pinned = bool(self._state.reasons())

    def apply_failed(self, effects: Sequence[Effect], statement: str | None = None) -> None:
        """A multi-statement text ended in an error: some statements may have run.

        Its transactional effects died with the (implicit or explicit)
        transaction; its non-transactional pins (PREPARE, advisory locks, LOAD)
        may have happened, so they are recorded, erring towards pinning. Unpins
        are ignored for the same reason. Not needed for single statements: a
        statement that failed changed nothing.
        """
        pins = tuple(e for e in effects if e.op == "pin" and not e.transactional)
        self.apply(pins, in_transaction=False, statement=statement)

    def commit(self) -> None:
        """The open transaction committed: its tentative effects become permanent."""
        self._snapshot = None
        self._nontransactional.clear()

    def rollback(self) -> None:
        """The open transaction rolled back: undo its transactional effects."""
        if self._snapshot is not None:
            self._state = self._snapshot
            for effect, statement in self._nontransactional:
                self._state.apply(effect, statement)
            self.pinned = bool(self._state.reasons())
        self._snapshot = None
        self._nontransactional.clear()

    def clear(self) -> None:
        """Forget everything (the server session is gone, or was DISCARDed by the proxy)."""
        self._state = _State()
        self._snapshot = None
        self._nontransactional.clear()
        self.pinned = False

    # -- questions ---------------------------------------------------------

    @property
    def tentative(self) -> bool:
        """Changes made inside a still-open transaction block await COMMIT or ROLLBACK."""
        return self._snapshot is not None

    def reasons(self) -> tuple[str, ...]:
        """Sorted names of the kinds of state held (``set``, ``temp_table``, ...)."""
        return self._state.reasons()

    @property
    def replayable(self) -> bool:
        """Pinned only by SET/PREPARE state that can all be re-created on a fresh server."""
        state = self._state
        return (
            self.pinned
            and _REPLAYABLE_REASONS.issuperset(state.reasons())
            and None not in state.settings.values()
            and None not in state.prepared.values()
        )

    def replay_statements(self) -> list[str]:
        """SQL that re-creates the replayable state: SETs, then PREPAREs, each in order made.

        Statements that cannot be replayed are left out; check :attr:`replayable` first.
        """
        state = self._state
        return [s for s in (*state.settings.values(), *state.prepared.values()) if s is not None]

    def pin_statement(self, reason: str) -> str | None:
        """The statement that first pinned ``reason`` (None if that reason is not held)."""
        return self._state.first_pins.get(reason)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for the admin API.

        ``statements`` and ``pinned_by`` carry SQL text as the client sent it,
        literals included: the admin layer anonymizes them before exposing them.
        """
        state = self._state
        return {
            "pinned": self.pinned,
            "reasons": list(self.reasons()),
            "replayable": self.replayable,
            "in_transaction_changes": self._snapshot is not None,
            "counts": {
                "set": len(state.settings),
                "prepare": len(state.prepared),
                "temp_table": len(state.temp),
                "cursor": len(state.cursors),
                "advisory_lock": state.advisory_locks,
                "listen": len(state.listen),
                **{reason: len(keys) for reason, keys in state.other.items() if keys},
            },
            "settings": sorted(state.settings),
            "prepared": sorted(state.prepared),
            "temp_tables": sorted(state.temp),
            "cursors": sorted(state.cursors),
            "listen": sorted(state.listen),
            "other": {reason: sorted(keys) for reason, keys in state.other.items() if keys},
            "statements": self.replay_statements(),
            "pinned_by": dict(state.first_pins),
        }
