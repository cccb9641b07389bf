"""The circuit breaker: stop sending transactions to a PostgreSQL that is failing.

One :class:`CircuitBreaker` per database (per backend host where a database has
several), per worker. It is a small state machine::

    CLOSED --failure_threshold consecutive failures / predictive / trip()--> OPEN
    OPEN --timeout_seconds elapsed (unless held by trip())-----------------> HALF_OPEN
    OPEN --a server login succeeded (opened because the server was gone)--> HALF_OPEN
    HALF_OPEN --success_threshold successes in a row--> CLOSED
    HALF_OPEN --any failure---------------------------> OPEN
    any state --reset()-------------------------------> CLOSED

While OPEN, :meth:`CircuitBreaker.allow` says no and the proxy answers the new
transaction at once with :meth:`CircuitBreaker.rejection_message` (SQLSTATE
57P03, retryable) instead of queueing it. Transactions already running are
never cut: their outcomes are still counted, but only change the state from
HALF_OPEN.

*Consecutive* failures open it, and any success resets the count. Hystrix
opens on an error *percentage* over a rolling 10 s window once a minimum
volume is reached; resilience4j on a failure *rate* over a sliding window of
calls (100 by default). A rate opens on partial sickness, which for a database
pooler means turning 20 % of failing transactions into 100 % refused ones.
The consecutive count opens only when PostgreSQL is answering nothing useful
(down, refusing connections, out of disk), needs no window on the hot path,
and is what an operator can reason about from the log. Partial sickness (a
rising error rate, a latency spike) is the health monitor's job
(``scry.health``); with ``health.predictive: true`` it opens the breaker too.

Concurrency: every method runs to completion without awaiting, so on one
asyncio loop each state change is atomic and no lock is ever taken. Each
worker owns its breakers; totals across workers are summed by the admin layer
from :meth:`CircuitBreaker.snapshot`, and manual trip/reset is sent to every
worker.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from scry.config import CircuitBreakerConfig

__all__ = [
    "BREAKER_OPEN_SQLSTATE",
    "CLOSED",
    "HALF_OPEN",
    "OPEN",
    "BreakerState",
    "CircuitBreaker",
    "Transition",
    "classify_sqlstate",
]

log = logging.getLogger(__name__)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Module-level aliases so the hot path is one identity check on a global.
CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN

#: cannot_connect_now: PostgreSQL's own "not now, try again" (it answers it while
#: starting up or shutting down). Npgsql's IsTransient, psycopg's
#: OperationalError and asyncpg's CannotConnectNowError all read it as transient,
#: and nothing of the refused transaction reached the server, so a retry is safe.
BREAKER_OPEN_SQLSTATE = "57P03"

# SQLSTATEs that say the *server* is sick rather than the query being wrong.
# Whole classes: 08 connection exception, 58 system error (I/O), XX internal.
_PROTOCOL_VIOLATION = "08P01"
# Class 53 insufficient resources, except 53400 configuration_limit_exceeded,
# which is one query hitting temp_file_limit and the like.
_SICK_NAMES = {
    "53000": "insufficient_resources",
    "53100": "disk_full",
    "53200": "out_of_memory",
    "53300": "too_many_connections",
    "57P01": "admin_shutdown",
    "57P02": "crash_shutdown",
    "57P03": "cannot_connect_now",
    "57P04": "database_dropped",
    # 57P05 idle_session_timeout is about an idle client, not the server.
}
_SICK_CODES = frozenset(_SICK_NAMES)
_SICK_CLASS_NAMES = {"08": "connection_exception", "58": "system_error", "XX": "internal_error"}
_QUERY_CANCELED = "57014"
# The server went away (shut down, crashed, not accepting yet) rather than being
# up and sick: once a login succeeds again, it is worth probing.
_GONE_CODES = frozenset({"57P01", "57P02", "57P03"})


def classify_sqlstate(code: str, *, query_timeout: bool = False) -> bool:
    """True when ``code`` means PostgreSQL itself is sick (a breaker failure).

    Sick: class 08, 53 (but 53400), 57P01-57P04, 58 and XX. 57014
    query_canceled counts only when scry cancelled the query for
    ``timeouts.query_timeout`` (pass ``query_timeout=True``); a user's own cancel
    or ``statement_timeout`` does not. Everything else (22 data exception, 23
    integrity constraint, 25 transaction state, 40 rollback, 42 syntax or
    access, ...) is the application's error and the server answered it fine.
    """
    if code == _PROTOCOL_VIOLATION:
        return False  # PostgreSQL refusing a client's malformed message: the client's fault
    if code in _SICK_CODES or code[:2] in _SICK_CLASS_NAMES:
        return True
    return query_timeout and code == _QUERY_CANCELED


def condition_name(code: str) -> str:
    """PostgreSQL's name for a sick ``code`` (or its class's), for reasons."""
    if code == _QUERY_CANCELED:
        return "query_canceled"
    return _SICK_NAMES.get(code) or _SICK_CLASS_NAMES.get(code[:2], "error")


class Transition(NamedTuple):
    """One state change: ``at`` on the breaker's clock, ``wall`` in epoch seconds."""

    at: float
    wall: float
    from_state: BreakerState
    to_state: BreakerState
    reason: str


TransitionHook = Callable[["CircuitBreaker", Transition], None]


class CircuitBreaker:
    """A circuit breaker for one database (or one backend host of it).

    ``name`` labels messages, logs and metrics (``"app"``, ``"app@db2:5432"``).
    ``now`` is a monotonic clock, injectable for tests; ``wall`` stamps
    transitions for people. ``on_transition`` is called after every state
    change (metrics, logs); it must return quickly and its errors are logged,
    never raised into the proxy.
    """

    def __init__(
        self,
        config: CircuitBreakerConfig | None = None,
        *,
        name: str = "",
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        history: int = 32,
        on_transition: TransitionHook | None = None,
    ) -> None:
        cfg = config if config is not None else CircuitBreakerConfig()
        self.name = name
        self.enabled = cfg.enabled
        self.failure_threshold = cfg.failure_threshold
        self.success_threshold = cfg.success_threshold
        self.timeout_seconds = float(cfg.timeout_seconds)
        self.half_open_max_probes = cfg.half_open_max_probes
        self.on_transition = on_transition
        self._now = now
        self._wall = wall

        self.state: BreakerState = CLOSED
        #: Opened by trip(): stays open until reset(), never goes half-open alone.
        self.held = False
        #: Why the breaker is (or last was) open.
        self.open_reason = ""
        self.opened_at = 0.0
        #: Opened because PostgreSQL was gone (failed logins, lost connections,
        #: shutdown errors): a successful server login ends OPEN early.
        self.opened_on_gone = False
        self.transitions: deque[Transition] = deque(maxlen=history)

        # Counters (this worker's, since start).
        self.failures = 0
        self.successes = 0
        self.rejections = 0
        self.consecutive_failures = 0
        self._streak_gone = False
        self.opened_count = 0
        self.last_failure_reason = ""

        # Half-open bookkeeping.
        self.probes_in_flight = 0
        self.probe_successes = 0
        self._last_probe_at = 0.0

    # ------------------------------------------------------------------ #
    # The hot path
    # ------------------------------------------------------------------ #

    def allow(self) -> bool:
        """May a NEW transaction start? Call once per transaction, before a server is taken.

        O(1); in the closed state one identity check and no allocation. False
        means: answer the client with :meth:`rejection_message` (the call has
        already counted the rejection). True in the half-open state means this
        transaction is a probe; its outcome must be reported with
        :meth:`record_success` or :meth:`record_failure` (or :meth:`release`).
        """
        if self.state is CLOSED:
            return True
        return self._allow_slow()

    def record_success(self) -> None:
        """The server answered normally (ReadyForQuery with no sickness error before it).

        User errors (syntax, constraint violations) are successes here: the
        server processed the query and said no.
        """
        self.successes += 1
        self.consecutive_failures = 0
        if self.state is not CLOSED:
            self._success_slow()

    def record_failure(self, reason: str, *, gone: bool = False) -> None:
        """Count a failure: connect failure, connection lost, query timeout, sick SQLSTATE.

        ``reason`` is short and human ("connection refused", "57P01 terminating
        connection due to administrator command") and ends up in the message
        clients see while the breaker is open. ``gone``: the failure says the
        server was not there (a failed login, a lost connection, a shutdown
        error); if it opens the breaker, :meth:`login_succeeded` may end OPEN early.
        """
        self.failures += 1
        self.consecutive_failures += 1
        # The streak says "gone" only if every failure in it does.
        self._streak_gone = gone and (self._streak_gone or self.consecutive_failures == 1)
        self.last_failure_reason = reason
        state = self.state
        if state is CLOSED:
            if self.enabled and self.consecutive_failures >= self.failure_threshold:
                reason = f"{self.consecutive_failures} consecutive failures: {reason}"
                self._open(reason, self._streak_gone)
        elif state is HALF_OPEN:
            self._open(f"probe failed: {reason}", gone)
        # OPEN: a transaction from before the breaker opened; counted, nothing more.

    def record_server_error(self, sqlstate: str, *, query_timeout: bool = False) -> bool:
        """Record a backend ErrorResponse; a failure only if :func:`classify_sqlstate` says so.

        Returns True when it counted as a failure (the proxy should then not
        call :meth:`record_success` for the same ReadyForQuery). The reason
        names the condition, never PostgreSQL's message: that can quote what
        a client sent (a file name, a RAISE's text), and the reason goes to
        the admin API, the log and every client the breaker refuses.
        """
        if not classify_sqlstate(sqlstate, query_timeout=query_timeout):
            return False
        gone = sqlstate in _GONE_CODES or sqlstate[:2] == "08"
        self.record_failure(f"{sqlstate} {condition_name(sqlstate)}", gone=gone)
        return True

    def login_succeeded(self) -> bool:
        """A server login succeeded; True if that moved the breaker to HALF_OPEN.

        A breaker opened because PostgreSQL was gone (a restart, a failover)
        need not refuse clients for the whole ``timeout_seconds`` once the
        server takes logins again: it goes half-open, and the usual probes
        decide. One opened on errors from a server that was up, by the health
        monitor or by an operator waits for its timeout (or reset) as before:
        a login proves nothing about those.
        """
        if self.state is OPEN and self.opened_on_gone and not self.held:
            self._move(HALF_OPEN, "a server login succeeded")
            return True
        return False

    def release(self) -> None:
        """A probe let through by :meth:`allow` ended without a verdict (the client left)."""
        if self.state is HALF_OPEN and self.probes_in_flight:
            self.probes_in_flight -= 1

    # ------------------------------------------------------------------ #
    # Operations (admin API, the health monitor's tick)
    # ------------------------------------------------------------------ #

    def trip(self, reason: str, *, hold: bool = True, gone: bool = False) -> bool:
        """Open the breaker now. Returns True if the state or hold changed.

        ``hold=True`` (the admin API's manual trip) keeps it open until
        :meth:`reset`, like resilience4j's FORCED_OPEN. ``hold=False`` (the
        predictive opening) behaves like an opening on failures: half-open
        after ``timeout_seconds``. A non-held trip is ignored when the breaker
        is disabled or already open. ``gone``: as in :meth:`record_failure` (a
        breaker opened by another worker says why it opened).
        """
        if not hold and (not self.enabled or self.state is OPEN):
            return False
        if self.state is OPEN:
            if self.held:
                return False
            self.held = True
            self.open_reason = reason
            self._record(OPEN, OPEN, reason)
            return True
        self.held = hold
        self._open(reason, gone)
        return True

    def reset(self, reason: str = "manual reset") -> bool:
        """Close the breaker now and forget the failure streak. True if it was not closed."""
        self.consecutive_failures = 0
        self.held = False
        if self.state is CLOSED:
            return False
        self._move(CLOSED, reason)
        return True

    def tick(self) -> None:
        """Move OPEN to HALF_OPEN once the timeout has passed; call about once a second.

        :meth:`allow` does this lazily too; the tick keeps the state that the
        admin API and metrics show honest when no client is asking.
        """
        if self.state is OPEN:
            self._maybe_half_open(self._now())
        elif self.state is HALF_OPEN:
            self._reclaim_stale_probes(self._now())

    def retry_after(self) -> float:
        """Seconds until the breaker next lets a transaction try (0 when closed)."""
        if self.state is CLOSED:
            return 0.0
        if self.state is HALF_OPEN:
            return 1.0
        if self.held:
            return math.inf
        remaining = max(0.0, self.opened_at + self.timeout_seconds - self._now())
        # Opened on a gone server: the proxy tries a login every second.
        return min(1.0, remaining) if self.opened_on_gone else remaining

    def rejection_message(self, database: str | None = None) -> tuple[str, str]:
        """The ``(sqlstate, message)`` for the ErrorResponse sent to a refused transaction."""
        db = database if database is not None else self.name
        if self.state is HALF_OPEN:
            probes = self.probes_in_flight
            return BREAKER_OPEN_SQLSTATE, (
                f"circuit breaker half-open for database {db}: PostgreSQL is recovering "
                f"({probes} probe{'s' if probes != 1 else ''} in flight, "
                f"{self.probe_successes}/{self.success_threshold} succeeded); retry in 1 s"
            )
        if self.held:
            return BREAKER_OPEN_SQLSTATE, (
                f"circuit breaker open for database {db}: tripped by an operator "
                f"({self.open_reason}); retry later"
            )
        wait = max(1, math.ceil(self.retry_after()))
        return BREAKER_OPEN_SQLSTATE, (
            f"circuit breaker open for database {db}: PostgreSQL is failing "
            f"({self.open_reason}); retry in {wait} s"
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the admin API: state, counters, recent transitions."""
        self.tick()
        now = self._now()
        retry = self.retry_after()
        return {
            "name": self.name,
            "state": self.state.value,
            "enabled": self.enabled,
            "held": self.held,
            "open_reason": self.open_reason if self.state is not CLOSED else None,
            "ends_on_login": self.state is OPEN and self.opened_on_gone and not self.held,
            "retry_in_seconds": None if math.isinf(retry) else round(retry, 3),
            "config": {
                "failure_threshold": self.failure_threshold,
                "success_threshold": self.success_threshold,
                "timeout_seconds": self.timeout_seconds,
                "half_open_max_probes": self.half_open_max_probes,
            },
            "counters": {
                "failures": self.failures,
                "successes": self.successes,
                "rejections": self.rejections,
                "consecutive_failures": self.consecutive_failures,
                "opened": self.opened_count,
            },
            "last_failure_reason": self.last_failure_reason or None,
            "half_open": {
                "probes_in_flight": self.probes_in_flight,
                "probe_successes": self.probe_successes,
            },
            "transitions": [
                {
                    "at": t.wall,
                    "seconds_ago": round(now - t.at, 3),
                    "from": t.from_state.value,
                    "to": t.to_state.value,
                    "reason": t.reason,
                }
                for t in reversed(self.transitions)
            ],
        }

    # ------------------------------------------------------------------ #
    # Internals (never on the closed-state hot path)
    # ------------------------------------------------------------------ #

    def _allow_slow(self) -> bool:
        now = self._now()
        if self.state is OPEN:
            self._maybe_half_open(now)
            if self.state is OPEN:
                self.rejections += 1
                return False
        else:
            self._reclaim_stale_probes(now)
        if self.state is HALF_OPEN and self.probes_in_flight < self.half_open_max_probes:
            self.probes_in_flight += 1
            self._last_probe_at = now
            return True
        self.rejections += 1
        return False

    def _success_slow(self) -> None:
        if self.state is not HALF_OPEN:
            return  # OPEN: a transaction from before; it does not close the breaker.
        if self.probes_in_flight:
            self.probes_in_flight -= 1
        self.probe_successes += 1
        if self.probe_successes >= self.success_threshold:
            self._move(CLOSED, f"{self.probe_successes} probes succeeded")

    def _maybe_half_open(self, now: float) -> None:
        if not self.held and now - self.opened_at >= self.timeout_seconds:
            self._move(HALF_OPEN, f"{self.timeout_seconds:g} s timeout elapsed")

    def _reclaim_stale_probes(self, now: float) -> None:
        # A probe whose client went quiet must not keep the breaker half-open
        # forever: after timeout_seconds its slot is given to a new probe.
        if self.probes_in_flight and now - self._last_probe_at >= self.timeout_seconds:
            self.probes_in_flight = 0

    def _open(self, reason: str, gone: bool = False) -> None:
        self.open_reason = reason
        self.opened_on_gone = gone
        self.opened_at = self._now()
        self.opened_count += 1
        self._move(OPEN, reason)

    def _move(self, to: BreakerState, reason: str) -> None:
        previous = self.state
        self.state = to
        self.probes_in_flight = 0
        self.probe_successes = 0
        if to is CLOSED:
            self.consecutive_failures = 0
        self._record(previous, to, reason)

    def _record(self, previous: BreakerState, to: BreakerState, reason: str) -> None:
        transition = Transition(self._now(), self._wall(), previous, to, reason)
        self.transitions.append(transition)
        hook = self.on_transition
        if hook is not None:
            try:
                hook(self, transition)
            except Exception:
                # Rare (a state change), so logging here is not on the hot path.
                log.exception("circuit breaker on_transition hook failed")
