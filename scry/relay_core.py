"""The relay's hot state: what a client and a server connection touch per message.

``ClientCore`` and ``ServerCore`` are the bases of ``ClientConnection`` and
``ServerConnection``; ``PoolStats`` holds a pool's SHOW STATS counters. When
setup.py could build ``scry/_relay.pyx`` they are its compiled classes: the
same fields as typed C struct members, plus a ``data_received`` that serves
the commonest chunks (one whole simple Query from a client; whole responses
made only of rows, CommandComplete and ReadyForQuery from a server; a
StartupMessage and md5 answer a ``LoginPlan`` covers) without running any
Python, and hands every other chunk to the connection's ``_data_received``.
Without a compiler they are the plain classes below and ``_data_received``
is the ``data_received`` itself.

The compiled fast paths do exactly what the general Python relay does for
those chunks (tests/unit/test_relay_fast.py drives both with the same
exchanges and compares every field).
"""

from __future__ import annotations

# A client connection's states (scry.client_login drives the first three).
STARTUP, AUTH, LOGIN, READY, CLOSED = "startup", "auth", "login", "ready", "closed"
# A server connection's states (see scry.server).
S_CONNECTING, S_LOGIN, S_IDLE, S_ACTIVE, S_INTERNAL, S_CLOSED = (
    "connecting",
    "login",
    "idle",
    "active",
    "internal",
    "closed",
)


# Client bytes held while waiting for a server before reading pauses.
MAX_QUEUED_BYTES = 256 * 1024


class PyPoolStats:
    """PgBouncer's per-pool traffic counters (SHOW STATS), bumped on the hot path.

    Plain attributes on a slots object: one add each, read only by the views.
    Times are in seconds (float); the console reports microseconds.
    """

    __slots__ = (
        "server_assignment_count", "xact_count", "query_count", "received", "sent",
        "xact_time", "query_time", "client_parse_count", "server_parse_count", "bind_count",
    )  # fmt: skip

    def __init__(self) -> None:
        # As PgBouncer counts (tests/integration/test_pgbouncer_stats.py compares):
        self.server_assignment_count = 0  # servers linked to a client
        self.query_count = 0  # requests answered in full (a pipeline counts once)
        self.xact_count = 0  # such answers ending idle (autocommit statements included)
        self.received = 0  # bytes from clients, their Terminate excepted
        self.sent = 0  # bytes from servers while linked to a client
        self.xact_time = 0.0
        self.query_time = 0.0
        # Named prepared statements only (transaction pooling), as PgBouncer 1.21+:
        self.client_parse_count = 0  # Parse from clients
        self.server_parse_count = 0  # Parse sent to servers (again on a new server)
        self.bind_count = 0  # Bind of a named statement


class PyLoginPlan:
    """What a client's login worked out from one exact StartupMessage, for the
    next client that sends the same bytes (see ClientLogin._plan_login)."""

    __slots__ = (
        "application_name", "database", "greeting", "max_client_conn", "md5_inner", "method",
        "pool", "secret", "settings", "statement_pooling", "transaction_pooling", "user",
        "welcome",
    )  # fmt: skip


class PyClientCore:
    """The fields of a client connection that the relay touches per message."""

    __slots__ = (
        "_early_syncs", "_messages", "_paused_waiting", "_plan", "_queue", "_queued_bytes",
        "_queued_owed", "_retried", "_salt", "_scanner", "_syncs_since_execute", "_unnamed_open",
        "_unsynced", "answered", "context", "inflight", "last_active", "observed", "ordinal",
        "params", "parked", "pins", "pool", "proxy", "server", "state", "statement_pooling",
        "stats", "t_acquired", "tracker", "transaction_pooling", "transport", "unanswered",
        "waiting_since",
    )  # fmt: skip


class PyServerCore:
    """The fields of a server connection that the relay touches per message."""

    __slots__ = (
        "_scanner", "applied", "breaker", "busy_since", "cancels_pending", "client", "copy",
        "desynced", "last_tag", "last_used", "observe", "paused_by_client", "pending", "pool",
        "ready_at", "retire", "sqlstate", "state", "statements", "stats", "swallow",
        "transport", "tx_status", "xact_mark",
    )  # fmt: skip


try:  # the compiled twins, built by setup.py when a C compiler is at hand
    from scry._relay import ClientCore, LoginPlan, PoolStats, ServerCore
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    ClientCore, PoolStats, ServerCore = PyClientCore, PyPoolStats, PyServerCore  # type: ignore[misc]
    LoginPlan = PyLoginPlan  # type: ignore[misc]

#: True when the compiled fast paths serve the relay.
COMPILED = ClientCore is not PyClientCore
