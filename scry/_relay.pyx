# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The relay's hot state and fast paths, compiled (see scry/relay_core.py).

``ClientCore`` and ``ServerCore`` are the bases of ``ClientConnection`` and
``ServerConnection``: their per-message fields are C struct members, and
their ``data_received`` serves the commonest chunks in C:

* from a client, one whole simple Query: what ``ClientConnection._relay_query``
  and ``_forward`` do, step for step, down to taking a server from the pool or
  joining its queue (and a lone Terminate);
* from a server, whole messages at a message boundary, none of them one the
  relay must parse (ParameterStatus, ErrorResponse, ParseComplete,
  CloseComplete, CopyInResponse): what ``ServerConnection._relay`` does for
  ReadyForQuery, CommandComplete, EmptyQueryResponse and PortalSuspended,
  then ``ClientConnection.on_server_ready``.
* from a client, a StartupMessage and an md5 answer that a ``LoginPlan``
  covers (what ``ClientLogin`` would work out again; the salt and the
  cancel key are drawn here).

``ClientCore`` also takes uvloop's ``connection_made`` and
``connection_lost``, and its ``__init__`` is ``ClientConnection``'s, so a
short-lived client runs little Python. ``PoolCore``, the base of ``Pool``,
holds what the fast paths read and change in a pool per transaction.

Anything else goes to the connection's Python ``_data_received``, which
stays the reference for every case (tests/unit/test_relay_fast.py and
test_login_fast.py hold the two to the same results). Why: live, the relay's per-transaction cost
follows how much code and data it touches, and a Python step touches a
frame, its code object, globals and a dozen attribute caches; here a step is
a few struct fields and one call into the transport.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.string cimport memcmp
from libc.time cimport timespec

from scry.protocol._scan cimport MessageScanner

import hashlib
import os as _os
from collections import deque
from logging import INFO as _INFO

from scry.breaker import CLOSED as BREAKER_CLOSED
from scry.hybrid import SessionTracker, TransactionTracker
# (isEnabledFor: logging_connections and logging_disconnections, a frame less)
from scry.log import connections_logger as _connections_logger
from scry.log import disconnections_logger as _disconnections_logger
from scry.observe.record import ClientContext
from scry.peering import RANDOM_MASK
from scry.protocol.classify import STATELESS_FIRST_WORDS
from scry.relay_core import (
    AUTH, CLIENT_MARK, CLIENT_WANT, CLOSED, LOGIN, MAX_QUEUED_BYTES, READY, S_ACTIVE, S_CLOSED,
    S_IDLE, STARTUP,
)

try:
    # CPython's own MD5. OpenSSL 3's (hashlib.md5) looks the algorithm up
    # and takes locks on every call: ~1.5 µs of a login's ~26 µs of user
    # time at pgbench -C, against a fraction of that here.
    from _md5 import md5 as _md5
except ImportError:  # a Python built without its own hashes
    _md5 = hashlib.md5
# AuthenticationMD5Password without its salt; ReadyForQuery 'I'.
_MD5_REQUEST = b"R\x00\x00\x00\x0c\x00\x00\x00\x05"
_READY_IDLE = b"Z\x00\x00\x00\x05I"

cdef long long _MAX_QUEUED = MAX_QUEUED_BYTES


cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk_id, timespec *tp)
    enum: CLOCK_MONOTONIC
    enum: CLOCK_REALTIME

# The clock of time.monotonic() and time.perf_counter_ns() on Linux.
cdef inline long long _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


# md5 salts and cancel keys for the logins served here, from the OS's CSPRNG
# 4 KiB at a time and taken from the end, as scry.protocol.auth._random_salt
# and scry.peering.new_cancel_key take theirs. Why not call those: two
# Python calls (three frames) a login cost ~2 µs live at pgbench -C.
cdef bytes _entropy = b""
cdef unsigned long long _RANDOM_MASK = RANDOM_MASK
cdef Py_ssize_t _entropy_left = 0


def _forget_entropy():
    """Drop what is left of the random bytes (a forked child draws its own)."""
    global _entropy_left
    _entropy_left = 0


_os.register_at_fork(after_in_child=_forget_entropy)


cdef const unsigned char* _random_bytes(Py_ssize_t n) except NULL:
    global _entropy, _entropy_left
    if _entropy_left < n:
        _entropy = _os.urandom(4096)
        _entropy_left = 4096
    _entropy_left -= n
    return <const unsigned char*>PyBytes_AS_STRING(_entropy) + _entropy_left


cdef unsigned long long _clients_made = 0  # (relay_core.client_numbers, compiled)


cdef str _next_client_id():
    """``f"c{next(client_numbers)}"`` in one allocation: at pgbench -C the
    int, its decimal conversion and the concatenation cost ~0.5 µs live.
    (A digit loop: 17 ns warm, against 67 for ``PyUnicode_FromFormat``.)"""
    global _clients_made
    _clients_made += 1
    cdef unsigned long long n = _clients_made
    cdef char digits[24]
    cdef int i = 23
    while True:
        digits[i] = <char>(48 + n % 10)
        n //= 10
        if n == 0:
            break
        i -= 1
    i -= 1
    digits[i] = 99  # 'c'
    return PyUnicode_DecodeASCII(digits + i, 24 - i, NULL)


cdef const unsigned char* _HEX_DIGITS = b"0123456789abcdef"


cdef bint _hex_matches(const unsigned char* text, bytes digest) except -1:
    """Whether ``text`` starts with ``digest`` in lowercase hex digits, as
    hmac.compare_digest would say of the two, in time that does not depend
    on where they differ (without making either string)."""
    cdef const unsigned char* d = <const unsigned char*>PyBytes_AS_STRING(digest)
    cdef Py_ssize_t i
    cdef unsigned char diff = 0
    for i in range(PyBytes_GET_SIZE(digest)):
        diff |= text[2 * i] ^ _HEX_DIGITS[d[i] >> 4]
        diff |= text[2 * i + 1] ^ _HEX_DIGITS[d[i] & 15]
    return diff == 0


cdef inline tuple _untracked(tuple entry):
    """``entry``, out of the cycle collector's sight: an inflight entry or
    a query record holds bytes, ints, None and tuples of those, so it can
    never be part of a cycle. Why: two tracked tuples a statement, alive
    until the drain (0.1 s), set off a collection every few hundred
    statements, each young collection walked them again, and those that
    survived grew the older generations until a full collection (0.9% of
    the proxy's samples in one 8 s profile at 10 clients)."""
    PyObject_GC_UnTrack(<void*>entry)
    return entry


cdef inline double _seconds(long long ns) noexcept nogil:
    return <double>ns / 1e9


cdef inline double _clock_seconds(int clock) noexcept nogil:
    """time.time() (CLOCK_REALTIME) or time.monotonic() (CLOCK_MONOTONIC)."""
    cdef timespec ts
    clock_gettime(clock, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec / 1e9


cdef inline Py_ssize_t _length_at(const unsigned char* p) noexcept nogil:
    return (<Py_ssize_t>p[0] << 24) | (p[1] << 16) | (p[2] << 8) | p[3]


cdef enum:
    # Message types (scry.protocol.messages).
    _Q = 81  # 'Q' Query
    _X = 88  # 'X' Terminate
    _Z = 90  # 'Z' ReadyForQuery
    _C = 67  # 'C' CommandComplete
    _I = 73  # 'I' EmptyQueryResponse
    _SUSPENDED = 115  # 's' PortalSuspended
    _TX_IDLE = 73  # 'I' in ReadyForQuery
    # scry.server's REC_* kinds of ClientConnection.inflight entries.
    REC_QUERY = 0
    REC_EXECUTE = 1
    REC_SYNC = 2


cdef inline unsigned char _lower(unsigned char c) noexcept nogil:
    return c + 32 if 65 <= c <= 90 else c  # ASCII only, as str.lower() leaves these words


cdef inline bint _word_at(const unsigned char* p, const char* word, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if _lower(p[i]) != <unsigned char>word[i]:
            return False
    return True


cdef bint _may_reset_server(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Whether the text holds 'discard' or 'deallocate' in any letter case: what
    TransactionTracker.on_query's regex looks for (ASCII case folding, as re's
    bytes patterns)."""
    cdef Py_ssize_t i
    for i in range(n):
        if (p[i] | 32) == 100:  # 'd' or 'D' (the cheapest test of every byte)
            if n - i >= 7 and _word_at(p + i, b"discard", 7):
                return True
            if n - i >= 10 and _word_at(p + i, b"deallocate", 10):
                return True
    return False


cdef bint _stateless_fast(const unsigned char* p, Py_ssize_t n) except -1:
    """classify._fast_str's common case on a Query body: the first word is a
    safe keyword followed by a space, none of its danger words occur, and
    nothing but white space follows a ";". True only when _fast_str says
    stateless too; False means "don't know" (SessionTracker.on_query decides).
    Non-ASCII bytes never match: str.lower() makes no ASCII letter out of
    them that could complete one of these words."""
    cdef unsigned char head[10]
    cdef Py_ssize_t i = 0
    cdef unsigned char c
    while i < n and i < 10:
        c = _lower(p[i])
        if c < 97 or c > 122:
            break
        head[i] = c
        i += 1
    if i == 0 or i == 10 or i == n or p[i] != 32:
        return False
    into_ok = STATELESS_FIRST_WORDS.get(PyBytes_FromStringAndSize(<char*>head, i))
    if into_ok is None:
        return False
    cdef bint into_counts = not into_ok
    cdef Py_ssize_t left, j
    for i in range(n):
        c = _lower(p[i])
        left = n - i
        if c == 59:  # ';': only white space (or the body's NUL) may follow
            for j in range(i + 1, n):
                c = p[j]
                if c != 32 and c != 0 and not (9 <= c <= 13):  # (\t \n \v \f \r)
                    return False
            return True
        if c == 97:
            if left >= 8 and _word_at(p + i, b"advisory", 8):
                return False
        elif c == 115:
            if left >= 10 and _word_at(p + i, b"set_config", 10):
                return False
        elif c == 112:
            if left >= 11 and _word_at(p + i, b"pg_settings", 11):
                return False
        elif c == 117:
            if left >= 2 and p[i + 1] == 38:  # u&
                return False
        elif c == 105:
            if into_counts and left >= 4 and _word_at(p + i, b"into", 4):
                return False
    return True


def stateless_text(bytes body) -> bool:
    """_stateless_fast of a Query body (for the tests)."""
    return _stateless_fast(<const unsigned char*>PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))


cdef class PoolStats:
    """PgBouncer's per-pool traffic counters (SHOW STATS), bumped on the hot path
    (the compiled twin of scry.relay_core.PyPoolStats)."""

    cdef public long long server_assignment_count, xact_count, query_count, received, sent
    cdef public double xact_time, query_time
    cdef public long long client_parse_count, server_parse_count, bind_count

    def __init__(self):
        self.server_assignment_count = 0
        self.xact_count = 0
        self.query_count = 0
        self.received = 0
        self.sent = 0
        self.xact_time = 0.0
        self.query_time = 0.0
        self.client_parse_count = 0
        self.server_parse_count = 0
        self.bind_count = 0


# A client's counters before it has a pool's (nobody reads them).
cdef PoolStats _NO_STATS = PoolStats()


cdef class LoginPlan:
    """What ``ClientLogin._begin_login`` worked out for one exact StartupMessage
    (the compiled twin of scry.relay_core.PyLoginPlan; see ClientLogin._plan_login)."""

    cdef public long long max_client_conn
    cdef public object user, database, settings, application_name, pool, welcome, greeting
    cdef public object method, secret, md5_inner, tracker_type
    cdef public bint transaction_pooling, statement_pooling, tracker_pinning


cdef class PoolCore:
    """The fields of a pool that the relay touches per transaction (the
    compiled twin of scry.relay_core.PyPoolCore; Pool sets them)."""

    cdef public object proxy, settings, breaker, welcome, idle, waiters
    cdef public dict parked
    cdef public set servers
    cdef public bint paused, stale, round_robin
    cdef public long long connecting, waits, total_wait_us
    cdef public double check_delay


cdef class ServerCore


cdef object _acquire_fast(PoolCore pool):
    """Pool.acquire_nowait, its commonest cases inline: the most recently used
    idle server, used recently enough to need no server_check_query; with
    none idle, the server of the longest-parked client (Pool._take_parked)."""
    if pool.paused:
        return None
    idle = pool.idle
    if idle and pool.round_robin:
        return pool.acquire_nowait()  # (not the default: the pool decides)
    if idle:
        server = idle.pop()
        if isinstance(server, ServerCore) and (<ServerCore>server).state is S_IDLE:
            delay = pool.check_delay
            if not delay or pool.proxy.clock - (<ServerCore>server).last_used <= delay:
                return server
        idle.append(server)  # (not that simple: the pool decides)
        return pool.acquire_nowait()
    parked = pool.parked
    while parked:
        client = next(iter(parked))
        if not isinstance(client, ClientCore):
            return pool.acquire_nowait()
        del parked[client]
        (<ClientCore>client).parked = False
        server = (<ClientCore>client)._detach_idle_fast()
        if server is not None:
            if len(pool.servers) + pool.connecting < pool.settings.size:  # (not pool.full)
                pool._spawn()  # room to grow: the parked client will want one back
            return server
    return None


cdef class ClientCore:
    """The per-message fields of a client connection, and its fast path."""

    cdef public object state, transport, tracker, inflight, pool, unanswered, context, pins
    cdef public object _messages, _scanner, _queue, params, proxy
    cdef public ServerCore server
    cdef public PoolStats stats
    cdef public long long ordinal, answered, t_acquired, waiting_since
    cdef public long long _queued_owed, _queued_bytes
    cdef public double last_active
    cdef public bint parked, observed, transaction_pooling, statement_pooling, _retried
    cdef public bint refuse_query
    cdef public bint _unsynced, _unnamed_open, _paused_waiting
    cdef public long _syncs_since_execute, _early_syncs
    cdef public object _plan, _salt
    # ClientConnection's own
    cdef public object id, user, database, application_name, cancel_key, statements
    cdef public object _addr, _auth, _reader, _startup_buf, _unnamed_rest
    cdef public object _last_text, _unnamed_text, _named_texts
    cdef public bint tls, _paused_by_server
    cdef public double connected_at, connected_clock

    def __cinit__(self, *args, **kwargs):
        # The first values that are not None, 0 or False (PyClientCore.start_fields).
        self.state = STARTUP
        self.transaction_pooling = True
        self.params = {}
        self._queue = []
        self.inflight = deque()
        self.user = ""
        self.database = ""
        self.application_name = ""
        self._startup_buf = bytearray()
        self._last_text = b""
        self._unnamed_text = b""
        self._named_texts = {}

    def __init__(self, proxy):
        """ClientConnection.__init__ (compiled: a login at pgbench -C spent
        ~3 µs live in its Python frame)."""
        self.proxy = proxy
        self.stats = _NO_STATS
        self._scanner = MessageScanner(
            CLIENT_WANT, proxy.config.max_packet_size, mark=CLIENT_MARK
        )
        self.observed = proxy.observatory.enabled
        self.id = _next_client_id()
        self.connected_at = _clock_seconds(CLOCK_REALTIME)
        self.connected_clock = _clock_seconds(CLOCK_MONOTONIC)

    def start_fields(self):
        """(Done by __cinit__: C struct members start at None, 0 and False.)"""

    # uvloop calls these two for every client, so they run no Python when
    # they can help it (pgbench -C: ~1 µs a connection in frames).

    def connection_made(self, transport):
        """ClientConnection._connection_made, with Proxy.on_client_connected's
        one line inline."""
        self.transport = transport
        self.proxy.clients.add(self)

    def connection_lost(self, exc):
        """ClientConnection._connection_lost, which has nothing to do for a
        client already closed (as every client that sent Terminate is)."""
        if self.state is not CLOSED:
            self._connection_lost(exc)

    def data_received(self, data):
        state = self.state
        if state is not READY or self._messages is not None or type(data) is not bytes:
            if type(data) is bytes:
                if state is STARTUP:
                    if self._startup_fast(<bytes>data):
                        return
                elif state is AUTH and self._plan is not None:
                    if self._password_fast(<bytes>data):
                        return
            self._data_received(data)
            return
        cdef bytes chunk = <bytes>data
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        scanner = self._scanner
        if type(scanner) is not MessageScanner or n < 5:
            self._data_received(data)
            return
        cdef MessageScanner s = <MessageScanner>scanner
        if s._remaining or PyBytes_GET_SIZE(s._held) or _length_at(p + 1) + 1 != n:
            self._data_received(data)
            return
        if p[0] == _X and n == 5:
            # A lone Terminate, how every client leaves (PgBouncer does not
            # count it in the bytes received).
            self._leave_fast()
            return
        if p[0] != _Q or n - 5 > s._max or n - 5 > s._max_collect or self.refuse_query:
            self._data_received(data)
            return
        # One whole Query: ClientConnection._relay, _relay_query and _forward.
        self.stats.received += n
        self._syncs_since_execute = 0
        self._early_syncs = 0
        self._unnamed_open = False  # a simple Query drops the unnamed statement
        self.ordinal += 1
        tracker = self.tracker
        body = None
        if tracker is not None:
            # (A text on_query would find nothing in is not shown to it.)
            if type(tracker) is TransactionTracker:
                ask = _may_reset_server(p + 5, n - 5)
            elif type(tracker) is SessionTracker:
                ask = not _stateless_fast(p + 5, n - 5)
            else:
                ask = True
            if ask:
                body = PyBytes_FromStringAndSize(<const char*>p + 5, n - 5)
                tracker.on_query(body, self.ordinal)
        cdef long long now = _now_ns()
        if self.observed:
            if body is None:
                body = PyBytes_FromStringAndSize(<const char*>p + 5, n - 5)
            self.inflight.append(_untracked((REC_QUERY, body, now)))
        self.last_active = _seconds(now)
        if self.parked:
            self._unpark_fast()
        cdef ServerCore server = self.server
        if server is None:
            self._queue_fast(chunk, n)
            return
        self.unanswered = None
        if server.pending == 0:
            server.busy_since = _seconds(now)
        server.pending += 1
        server.statements.segments_sent += 1
        server.transport.write(chunk)

    cdef bint _startup_fast(self, bytes chunk) except -1:
        """A StartupMessage seen before, whole in one chunk: what
        ClientLogin._startup_data and _begin_login would work out again is
        the proxy's LoginPlan for these exact bytes."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        if n < 8 or _length_at(p) != n or _length_at(p + 4) != 196608:  # protocol 3.0
            return False
        proxy = self.proxy
        found = proxy.login_plans.get(chunk)
        if type(found) is not LoginPlan:
            return False
        cdef LoginPlan plan = <LoginPlan>found
        cdef PoolCore pool = plan.pool
        if (
            pool is None
            or pool.stale
            or pool.welcome is not plan.welcome
            or proxy.draining
            or self.tls
            or self._startup_buf
            or len(proxy.clients) > plan.max_client_conn
        ):
            return False
        self.user = plan.user
        self.database = plan.database
        self.params = plan.settings
        self.application_name = plan.application_name
        self.pool = pool
        self.stats = pool.stats
        self.transaction_pooling = plan.transaction_pooling
        self.statement_pooling = plan.statement_pooling
        tracker_type = plan.tracker_type  # (ClientLogin._new_tracker's choice)
        self.tracker = None if tracker_type is None else tracker_type(self.id, plan.tracker_pinning)
        self._plan = plan
        if plan.md5_inner is None:  # trust
            self._login_done(plan)
            return True
        self.state = AUTH
        salt = PyBytes_FromStringAndSize(<const char*>_random_bytes(4), 4)
        self._salt = salt
        self.transport.write(_MD5_REQUEST + salt)
        return True

    cdef bint _password_fast(self, bytes chunk) except -1:
        """The right md5 answer to a planned login's challenge, whole in one
        chunk; anything else (a wrong one included) is ClientLogin's."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        # 'p', length, "md5" + 32 hex digits, NUL
        if n != 41 or p[0] != 112 or _length_at(p + 1) != 40 or p[40] != 0:
            return False
        cdef LoginPlan plan = <LoginPlan>self._plan
        cdef PoolCore pool = plan.pool
        if pool is None or pool.welcome is not plan.welcome:
            return False
        if memcmp(p + 5, b"md5", 3) != 0 or not _hex_matches(
            p + 8, _md5(plan.md5_inner + self._salt).digest()
        ):
            return False
        self._login_done(plan)
        return True

    cdef void _login_done(self, LoginPlan plan) except *:
        """ClientLogin._auth_step's success and _complete_login."""
        self.state = LOGIN
        self._plan = None
        self._salt = None
        proxy = self.proxy
        # Proxy.register_cancel_key: a fresh key (9 random bits of pid, never
        # all zero, and 32 of secret: peering.new_cancel_key's layout).
        keys = proxy.cancel_keys
        cdef unsigned long long base = proxy.cancel_pid_base, bits, rnd
        cdef unsigned int upid, usecret
        cdef const unsigned char* r
        while True:
            r = _random_bytes(8)
            bits = (<unsigned long long>r[0] | <unsigned long long>r[1] << 8
                    | <unsigned long long>r[2] << 16 | <unsigned long long>r[3] << 24
                    | <unsigned long long>r[4] << 32 | <unsigned long long>r[5] << 40
                    | <unsigned long long>r[6] << 48 | <unsigned long long>r[7] << 56)
            rnd = (bits >> 32) & _RANDOM_MASK
            upid = <unsigned int>(base | (rnd if rnd else 1))
            usecret = <unsigned int>bits  # (the low 32 bits)
            cancel_key = (upid, usecret)
            if cancel_key not in keys:
                break
        keys[cancel_key] = self
        self.cancel_key = cancel_key
        cdef unsigned char key[13]
        key[0] = 75  # 'K' BackendKeyData
        key[1] = 0
        key[2] = 0
        key[3] = 0
        key[4] = 12
        key[5] = (upid >> 24) & 0xFF
        key[6] = (upid >> 16) & 0xFF
        key[7] = (upid >> 8) & 0xFF
        key[8] = upid & 0xFF
        key[9] = (usecret >> 24) & 0xFF
        key[10] = (usecret >> 16) & 0xFF
        key[11] = (usecret >> 8) & 0xFF
        key[12] = usecret & 0xFF
        self.transport.write(
            plan.greeting + PyBytes_FromStringAndSize(<char*>key, 13) + _READY_IDLE
        )
        self.state = READY
        # (tuple.__new__: the NamedTuple's own __new__ is a Python function)
        # (False: a plan is only made for sessions reading strings as "on")
        self.context = tuple.__new__(ClientContext, (
            self.id, self.database, self.user, self.application_name, proxy.worker_id, False
        ))
        if _connections_logger.isEnabledFor(_INFO):
            self._log_login()

    cdef void _leave_fast(self) except *:
        """ClientConnection._cleanup("client closed") of a client at rest in
        transaction pooling: its server (parked with it, or none) goes back
        to the pool as _give_back would, with no reset (a desynced one is
        _hand_over's to close); else _cleanup."""
        cdef ServerCore server = self.server
        cdef PoolCore pool = self.pool
        if self.waiting_since or pool is None or not self.transaction_pooling:
            self._cleanup("client closed")
            return
        if server is not None:
            tracker = self.tracker
            if (
                server.state is not S_ACTIVE
                or not server._settled_fast()
                or not self._at_boundary_fast()
                or (tracker is not None and tracker.pinned)
                or pool.settings.server_reset_query_always
            ):
                self._cleanup("client closed")
                return
        self.state = CLOSED
        if self.parked:
            self.parked = False
            pool.parked.pop(self, None)
        if server is not None:
            self.server = None
            server._hand_over(pool)
        self.transport.close()
        proxy = self.proxy  # (Proxy.on_client_closed inline)
        proxy.clients.discard(self)
        cancel_key = self.cancel_key
        if cancel_key is not None:
            proxy.cancel_keys.pop(cancel_key, None)
        if _disconnections_logger.isEnabledFor(_INFO):
            self._log_closed("client closed")

    cdef void _queue_fast(self, bytes chunk, Py_ssize_t n) except *:
        """ClientConnection._forward with no server: queue the Query, then
        _get_server (inline while the breaker is closed: a server from the
        pool, or the pool's queue)."""
        self._queue.append((chunk, 1))
        self._queued_owed += 1
        self._queued_bytes += n
        if self._queued_bytes > _MAX_QUEUED and not self._paused_waiting:
            # Bound what a client can make us hold while it waits for a server.
            self._paused_waiting = True
            self.transport.pause_reading()
        if self.state is not READY or self.waiting_since:
            return  # (already queued at the pool)
        cdef PoolCore pool = self.pool
        if pool is None or self.proxy.draining or pool.breaker.state is not BREAKER_CLOSED:
            self._get_server()  # (it refuses the query)
            return
        if pool.idle or pool.parked:
            server = _acquire_fast(pool)
            if server is not None:
                self._link_fast(server, _now_ns())
                return
        # No timer per wait: the janitor enforces query_wait_timeout on the queue.
        self.waiting_since = _now_ns()
        settings = pool.settings
        if (
            not pool.paused
            and not settings.reserve_size
            and len(pool.servers) + pool.connecting >= settings.size  # (pool.full)
        ):
            pool.waiters.append(self)  # Pool.wait of a full pool: nothing to open
        else:
            pool.wait(self)

    cdef void _link_fast(self, ServerCore server, long long now) except *:
        """ClientConnection._link: take ``server`` and send it what waited."""
        self.server = server
        self.stats.server_assignment_count += 1
        server._link_fast(self)
        tracker = self.tracker
        if tracker is not None and tracker.needs_replay:
            self._replay_on(server)
        queue = self._queue
        if not queue:
            return
        if len(queue) != 1 or type(queue[0][0]) is not bytes:
            self._send_queue(server)
            return
        data, owed = queue[0]
        server.statements.segments_sent += owed
        # Kept until the server answers: if it dies first, nothing ran and
        # the same messages can go to another server.
        self.unanswered = queue
        self._queue = []
        server.busy_since = _seconds(now)
        server.pending += self._queued_owed
        self._queued_owed = 0
        self._queued_bytes = 0
        server.transport.write(data)

    cdef bint _attach_fast(self, ServerCore server, PoolCore pool) except -1:
        """ClientConnection.attach: the pool hands this waiting client ``server``."""
        if self.state is not READY:
            return False
        cdef long long now = _now_ns()
        pool.total_wait_us += (now - self.waiting_since) // 1000
        pool.waits += 1
        self.waiting_since = 0
        self.t_acquired = now
        self._link_fast(server, now)
        if self._paused_waiting:
            self._paused_waiting = False
            self._update_reading()
        return True

    cdef object _detach_idle_fast(self):
        """ClientConnection.detach_idle_server."""
        cdef ServerCore server = self.server
        if (
            server is None
            or self.state is not READY
            or server.cancels_pending
            or server.desynced
            or server.state is S_CLOSED
            or not server._settled_fast()
            or not self._at_boundary_fast()
        ):
            return None
        tracker = self.tracker
        if tracker is not None and tracker.pinned:
            return None
        self.server = None
        server._unlink_fast()
        return server

    cdef void _unpark_fast(self) except *:
        """ClientConnection._unpark: a parked client starts a new transaction."""
        self.parked = False
        cdef PoolCore pool = self.pool
        if pool is None:
            return
        pool.parked.pop(self, None)
        if pool.breaker.state is not BREAKER_CLOSED or pool.paused:
            # New transactions must pass the breaker: give the server back and
            # take the ordinary path, which asks it.
            server = self.detach_idle_server()
            if server is not None:
                pool.release(server)

    cdef bint _at_boundary_fast(self) except -1:
        """ClientConnection._at_boundary."""
        if self._unsynced:
            return False
        if self._messages is not None:
            return self._messages.buffered == 0
        scanner = self._scanner
        if type(scanner) is MessageScanner:
            return (<MessageScanner>scanner)._remaining == 0 and PyBytes_GET_SIZE(
                (<MessageScanner>scanner)._held
            ) == 0
        return scanner.at_boundary


cdef class ServerCore:
    """The per-message fields of a server connection, and its fast path."""

    cdef public object state, transport, statements, sqlstate, breaker, last_tag, observe, pool
    cdef public object _scanner, applied, observed_queue, wake_drain
    cdef public Py_ssize_t drain_at
    cdef bytes _tag_seen
    cdef public ClientCore client
    cdef public PoolStats stats
    cdef public long long pending, swallow, copy, cancels_pending
    cdef public int tx_status
    cdef public double busy_since, xact_mark, ready_at, last_used
    cdef public bint desynced, retire, paused_by_client, close_needed

    def __cinit__(self, *args, **kwargs):
        self._tag_seen = b""

    def data_received(self, data):
        if self.state is not S_ACTIVE or self.swallow or self.copy or type(data) is not bytes:
            self._data_received(data)
            return
        cdef ClientCore client = self.client
        scanner = self._scanner
        if (
            client is None
            or client.statement_pooling
            or (self.pending <= 0 and client.parked)
            or type(scanner) is not MessageScanner
        ):
            self._data_received(data)
            return
        cdef MessageScanner s = <MessageScanner>scanner
        cdef bytes chunk = <bytes>data
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        if s._remaining or PyBytes_GET_SIZE(s._held):
            self._data_received(data)
            return
        # Only whole messages, none that ServerConnection._relay must parse.
        cdef Py_ssize_t pos = 0, end, length
        cdef int kind, want
        while pos < n:
            if n - pos < 5:
                self._data_received(data)
                return
            kind = p[pos]
            length = _length_at(p + pos + 1)
            end = pos + 1 + length
            want = s._table[kind]
            if length < 4 or length - 4 > s._max or end > n or (
                want >= 0 and not (
                    (kind == _Z and length == 5)
                    or (kind == _C and length - 4 <= s._max_collect)
                    or kind == _I or kind == _SUSPENDED
                )
            ):
                self._data_received(data)
                return
            pos = end
        # ServerConnection._relay for ReadyForQuery, CommandComplete,
        # EmptyQueryResponse and PortalSuspended (no swallow, no COPY).
        cdef PoolStats stats = self.stats
        stats.sent += n
        cdef bint release = False
        cdef long long t_done = 0, pending, now_ns
        cdef double now
        cdef int status
        inflight = client.inflight
        pos = 0
        while pos < n:
            kind = p[pos]
            end = pos + 1 + _length_at(p + pos + 1)
            if s._table[kind] < 0:
                pos = end
                continue
            if kind == _Z:
                status = p[pos + 5]
                self.tx_status = status
                pending = self.pending - 1
                self.pending = pending
                client.answered += 1
                now_ns = _now_ns()
                now = _seconds(now_ns)
                if pending <= 0:
                    # PgBouncer's counters: a query is a request up to the
                    # ReadyForQuery that answers all it sent; a transaction ends
                    # at such a ReadyForQuery that says idle.
                    stats.query_count += 1
                    stats.query_time += now - self.busy_since
                    if status == _TX_IDLE:
                        stats.xact_count += 1
                        stats.xact_time += now - (self.xact_mark or self.busy_since)
                        self.xact_mark = 0.0
                        release = True
                    else:
                        release = False
                        if not self.xact_mark:
                            self.xact_mark = self.busy_since
                    self.ready_at = now
                    if pending < 0:
                        self.desync("a ReadyForQuery nobody asked for")
                tracker = client.tracker
                if tracker is not None and tracker.work:
                    tracker.settle(
                        client.answered, self.sqlstate, status, self, self.pool.proxy.clock
                    )
                    client.pins = tracker.reasons()
                statements = self.statements
                statements.segments_done += 1
                if statements.expect:
                    statements.on_ready()
                sqlstate = self.sqlstate
                if sqlstate is not None:
                    self.sqlstate = None
                else:
                    breaker = self.breaker
                    if breaker.state is not BREAKER_CLOSED or breaker.consecutive_failures:
                        breaker.record_success()  # only news when something was wrong
                if inflight:
                    if inflight[0][0] == REC_SYNC:
                        inflight.popleft()  # the end of an extended-protocol batch
                    else:  # a simple Query (or FunctionCall) is complete
                        if not t_done:
                            t_done = now_ns
                        self._record_fast(client, self.last_tag, sqlstate, t_done)
                self.last_tag = b""
            elif kind == _C:
                # The tag object of the last CommandComplete when the bytes
                # are the same (pgbench's are): no new bytes, and its hash
                # is already cached for the drain's rows lookup.
                tag = self._tag_seen
                if PyBytes_GET_SIZE(tag) != end - pos - 5 or memcmp(
                    PyBytes_AS_STRING(tag), p + pos + 5, end - pos - 5
                ):
                    tag = PyBytes_FromStringAndSize(<const char*>p + pos + 5, end - pos - 5)
                    self._tag_seen = tag
                self.last_tag = tag
                if inflight and inflight[0][0] == REC_EXECUTE:
                    if not t_done:
                        t_done = _now_ns()
                    self._record_fast(client, tag, None, t_done)
            else:  # EmptyQueryResponse, PortalSuspended
                if inflight and inflight[0][0] == REC_EXECUTE:
                    if not t_done:
                        t_done = _now_ns()
                    self._record_fast(client, b"", None, t_done)
            pos = end
        if self.state is S_CLOSED:
            return  # the client was just dropped
        client.unanswered = None
        client.transport.write(chunk)
        if release:
            self._ready_fast(client)

    cdef void _record_fast(self, ClientCore client, tag, sqlstate, long long t_done) except *:
        """ServerConnection._record: one statement is complete, one append."""
        _, text, t_received = client.inflight.popleft()
        # The same int objects for equal times (no server to wait for, and
        # t_sent is t_acquired): fewer allocations here and frees in the drain.
        t_acquired = t_received
        if client.t_acquired > <long long>t_received:
            t_acquired = client.t_acquired
        self.observe(
            _untracked(
                (client.context, text, t_received, t_acquired, t_acquired, t_done, tag, sqlstate,
                 client.pins)
            )
        )
        if len(self.observed_queue) == self.drain_at:
            self.wake_drain()

    cdef void _ready_fast(self, ClientCore client) except *:
        """ClientConnection.on_server_ready: give the server back if pooling allows."""
        if self.close_needed:
            client.server_must_go(self)  # (server_fast_close: rare, and the client decides)
            return
        if not client.transaction_pooling or not client._at_boundary_fast():
            return
        tracker = client.tracker
        if tracker is not None and type(tracker) is not TransactionTracker and tracker.pinned:
            return  # session state lives on this server: keep it
        client._retried = False
        cdef PoolCore pool = client.pool
        if pool is None:
            return
        if (
            not pool.waiters
            and not pool.paused
            and client.answered > 1
            and (pool.idle or len(pool.servers) + pool.connecting < pool.settings.size)  # (not pool.full)
        ):
            # Nobody needs it now: keep it (no release/acquire per transaction)
            # and hand it over as soon as another client asks for one (not after
            # its first answer, nor when it is the last free server: see
            # ClientConnection.on_server_ready).
            if not client.parked:
                client.parked = True
                pool.parked[client] = None
            return
        client.server = None
        self._hand_over(pool)

    cdef bint _settled_fast(self) except -1:
        """ServerConnection.settled, of a server that is not closed."""
        scanner = self._scanner
        if self.pending > 0 or self.swallow != 0 or self.tx_status != _TX_IDLE:
            return False
        if type(scanner) is MessageScanner:
            return (<MessageScanner>scanner)._remaining == 0 and PyBytes_GET_SIZE(
                (<MessageScanner>scanner)._held
            ) == 0
        return scanner.at_boundary

    cdef void _link_fast(self, ClientCore client) except *:
        """ServerConnection.link: serve ``client``."""
        self.state = S_ACTIVE
        self.client = client
        self.pending = 0
        self.copy = 0
        statements = self.statements
        if statements.expect:  # all answered while idle; nothing may linger
            statements.expect.clear()
        if client._messages is None:
            # Its unnamed Parses are not followed: the unnamed statement is nobody's.
            statements.unnamed_owner = None
        wanted = client.params
        if self.applied is not wanted:
            self._apply_settings(wanted)

    cdef void _unlink_fast(self) except *:
        """ServerConnection.unlink."""
        self.client = None
        self.state = S_IDLE
        if self.paused_by_client:
            self.paused_by_client = False
            self.transport.resume_reading()

    cdef void _hand_over(self, PoolCore pool) except *:
        """ServerConnection.unlink, then Pool.release: the commonest case (a
        clean server straight to the oldest waiting client) inline."""
        self._unlink_fast()
        # (Clean: nothing owed, idle, at a boundary; _ready_fast is only called so.)
        if self.cancels_pending or self.desynced or self.retire or pool.stale:
            pool.release(self)
            return
        waiters = pool.waiters
        while waiters and not pool.paused:
            waiter = waiters.popleft()
            if isinstance(waiter, ClientCore):
                if (<ClientCore>waiter)._attach_fast(self, pool):
                    return
            elif waiter.attach(self):
                return
        self.last_used = pool.proxy.clock
        pool.idle.append(self)
