"""The relay's hot state: what client and server connections and pools touch per message.

``ClientCore`` and ``ServerCore`` are the bases of ``ClientConnection`` and
``ServerConnection``, ``PoolCore`` that of ``Pool``; ``PoolStats`` holds a
pool's SHOW STATS counters. When setup.py could build ``scry/_relay.pyx``
they are its compiled classes: the same fields as typed C struct members,
plus a ``data_received`` that serves the commonest chunks (one whole simple
Query from a client; whole responses made only of rows, CommandComplete and
ReadyForQuery from a server; a StartupMessage and md5 answer a
``LoginPlan`` covers) without running any Python, and hands every other
chunk to the connection's ``_data_received``.
Without a compiler they are the plain classes below and ``_data_received``
is the ``data_received`` itself.

The compiled fast paths do exactly what the general Python relay does for
those chunks (tests/unit/test_relay_fast.py drives both with the same
exchanges and compares every field).
"""

from __future__ import annotations

import itertools
from collections import deque

from scry.protocol import messages as m

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

# Client messages the relay must see (every other one is forwarded unread).
CLIENT_WANT = (
    m.QUERY,
    m.SYNC,
    m.FUNCTION_CALL,
    m.TERMINATE,
    m.EXECUTE,
    m.COPY_DONE,
    m.COPY_FAIL,
    m.PARSE,
)
# Reported without their bodies: enough to know a batch is open until its Sync.
CLIENT_MARK = (m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH)

# Numbers the clients' ids ("c1", "c2", ...), in this process (the Python
# ClientConnection's; the compiled ClientCore keeps the same count in C).
client_numbers = itertools.count(1)


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
        "pool", "secret", "settings", "statement_pooling", "tracker_pinning", "tracker_type",
        "transaction_pooling", "user", "welcome",
    )  # fmt: skip


class PyClientCore:
    """The fields of a client connection that the relay touches per message."""

    __slots__ = (
        "_early_syncs", "_messages", "_paused_waiting", "_plan", "_queue", "_queued_bytes",
        "_queued_owed", "_retried", "_salt", "_scanner", "_syncs_since_execute", "_unnamed_open",
        "_unsynced", "answered", "context", "inflight", "last_active", "observed", "ordinal",
        "params", "parked", "pins", "pool", "proxy", "refuse_query", "server", "state",
        "statement_pooling", "stats", "t_acquired", "tracker", "transaction_pooling",
        "transport", "unanswered", "waiting_since",
        # ClientConnection's own (struct members too, so that a login sets them in C)
        "_addr", "_auth", "_last_text", "_named_texts", "_paused_by_server", "_reader",
        "_startup_buf", "_unnamed_rest", "_unnamed_text", "application_name", "cancel_key",
        "connected_at", "connected_clock", "database", "id", "statements", "tls", "user",
    )  # fmt: skip

    def start_fields(self) -> None:
        """Every field's first value that does not depend on the proxy (what
        the compiled ClientCore starts with); ClientConnection.__init__ sets
        the rest."""
        self.state = STARTUP
        self.transport = None
        self.params = {}  # settings to apply on any server that serves us
        self.pool = None
        self.server = None
        self.transaction_pooling = True
        self.statement_pooling = False
        self.refuse_query = False  # disable_pqexec: a simple Query ends the connection
        self.tracker = None  # transaction and hybrid modes
        self.parked = False  # holding a server between transactions (see Pool.parked)
        self.ordinal = 0  # ReadyForQuery messages owed to this client, ever
        self.answered = 0  # ReadyForQuery messages it received, ever
        self.last_active = 0.0  # proxy.clock at its last message
        self._plan = None  # a login ClientCore took in (ClientLogin._plan_login)
        self._salt = None  # its md5 challenge
        # Extended-protocol messages sent since the last Sync: the server owes
        # nothing yet but is mid-batch, so it must not change hands.
        self._unsynced = False
        # An unnamed statement was parsed and not yet executed (pg8000 parses,
        # syncs, then binds): the Bind may land on another server.
        self._unnamed_open = False
        # Client data waiting for a server: (bytes or whole messages, ReadyForQuery owed).
        self._queue = []
        self._queued_owed = 0
        self._queued_bytes = 0
        self._paused_waiting = False
        # Set once the client uses named prepared statements under transaction or
        # hybrid pooling: from then on its messages are read whole and rewritten.
        self._messages = None
        self.unanswered = None
        self.context = None  # observability: who the records are of (scry.observe.record)
        # (REC_* kind, statement text, received ns): what the server side will complete.
        self.inflight = deque()
        self.t_acquired = 0  # when the last waited-for server was linked
        self.pins = None
        self._retried = False
        self._syncs_since_execute = 0
        self._early_syncs = 0  # of those, sent right after it (libpq's Execute, Sync)
        self.waiting_since = 0  # perf_counter_ns() when it joined the pool's queue; 0 = not
        # ClientConnection's
        self._addr = None  # "host:port", looked up when first needed (ClientConnection.addr)
        self.user = ""
        self.database = ""
        self.application_name = ""
        self.tls = False
        self.cancel_key = None
        self._startup_buf = bytearray()
        self._reader = None  # a MessageReader once logged in
        self._auth = None  # a ClientAuthExchange while authenticating
        self._unnamed_rest = None  # its last unnamed Parse, after the name
        self._last_text = b""  # the statement the next Execute runs
        self._unnamed_text = b""  # the unnamed prepared statement's text
        self._named_texts = {}  # named statement -> its text
        self.statements = None  # ClientStatements, once it prepares named statements
        self._paused_by_server = False


class PyPoolCore:
    """The fields of a pool that the relay touches per transaction (Pool sets
    them; see scry.pool.Pool.__init__ for what they mean)."""

    __slots__ = (
        "breaker", "check_delay", "connecting", "idle", "parked", "paused", "proxy", "round_robin",
        "servers", "settings", "stale", "total_wait_us", "waiters", "waits", "welcome",
    )  # fmt: skip


class PyServerCore:
    """The fields of a server connection that the relay touches per message."""

    __slots__ = (
        "_scanner", "applied", "breaker", "busy_since", "cancels_pending", "client", "copy",
        "close_needed", "desynced", "drain_at", "last_tag", "last_used", "observe", "observed_queue",
        "paused_by_client", "pending", "pool", "ready_at", "retire", "sqlstate", "state",
        "statements", "stats", "swallow", "transport", "tx_status", "wake_drain", "xact_mark",
    )  # fmt: skip


try:  # the compiled twins, built by setup.py when a C compiler is at hand
    from scry._relay import ClientCore, LoginPlan, PoolCore, PoolStats, ServerCore
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    ClientCore, PoolStats, ServerCore = PyClientCore, PyPoolStats, PyServerCore  # type: ignore[misc]
    LoginPlan, PoolCore = PyLoginPlan, PyPoolCore  # type: ignore[misc]

#: True when the compiled fast paths serve the relay.
COMPILED = ClientCore is not PyClientCore
