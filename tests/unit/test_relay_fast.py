"""The compiled relay fast paths (scry/_relay.pyx) against the Python relay.

Two identical rigs (one pool, two servers, three clients, fake transports)
are driven through the same random exchanges: clients send simple queries,
transaction blocks, errors, extended-protocol batches, pipelines and
statements that change session state; servers answer them whole, split at
any byte, or with messages the fast path leaves to Python (ParameterStatus,
ErrorResponse, ParseComplete, notices). In one rig every chunk goes through
the connections' ``data_received`` (the compiled fast paths first); in the
other straight to ``_data_received`` (the Python relay, the reference).
After every step both rigs must agree on everything: the bytes each
transport was given, every counter and field the relay keeps, which client
holds which server, the pool's queue, parking and statistics, and the
observability records.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest
from fake_transport import Recorder, msg, offline_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry import relay_core
from scry.client import READY, ClientConnection
from scry.config import Config
from scry.hybrid import SessionTracker, TransactionTracker
from scry.protocol import messages as m
from scry.proxy import Proxy
from scry.server import IDLE, ServerConnection

pytestmark = pytest.mark.skipif(not relay_core.COMPILED, reason="the extension was not built")


def rfq(status: str) -> bytes:
    return m.ready_for_query(ord(status))


ROWS = m.row_description([("n", 23)]) + m.data_row(["1"]) + m.data_row(["2"])
NOTICE = msg(b"N", b"SNOTICE\x00C00000\x00Mhello\x00\x00")
PARAMETER = m.parameter_status("application_name", "other")
ERROR = m.error_response("22012", "division by zero")
PARSE_COMPLETE, BIND_COMPLETE = msg(b"1"), msg(b"2")


def extended(text: str) -> bytes:
    return (
        msg(b"P", b"\x00" + text.encode() + b"\x00\x00\x00")
        + msg(b"B", b"\x00\x00\x00\x00\x00\x00\x00\x00")
        + msg(b"D", b"P\x00")
        + msg(b"E", b"\x00\x00\x00\x00\x00")
        + msg(b"S")
    )


# name -> (client bytes, a function of the transaction status so far ('I', 'T'
# or 'E') giving PostgreSQL's answer and the status after it).
REQUESTS: dict[str, tuple[bytes, Any]] = {
    "select": (
        m.query("SELECT n FROM t WHERE id = 42"),
        lambda tx: (ROWS + m.command_complete("SELECT 2") + rfq(tx), tx),
    ),
    "select_notice": (
        m.query("SELECT n FROM t WHERE id = 7"),
        lambda tx: (NOTICE + ROWS + m.command_complete("SELECT 2") + rfq(tx), tx),
    ),
    "begin": (m.query("BEGIN"), lambda tx: (m.command_complete("BEGIN") + rfq("T"), "T")),
    "commit": (m.query("COMMIT"), lambda tx: (m.command_complete("COMMIT") + rfq("I"), "I")),
    "error": (
        m.query("SELECT 1/0"),
        lambda tx: (ERROR + rfq("E" if tx != "I" else "I"), "E" if tx != "I" else "I"),
    ),
    "rollback": (
        m.query("ROLLBACK"),
        lambda tx: (m.command_complete("ROLLBACK") + rfq("I"), "I"),
    ),
    "empty": (m.query(""), lambda tx: (msg(b"I") + rfq(tx), tx)),
    # A ReadyForQuery nobody asked for: the server is closed, never reused.
    "stray_ready": (
        m.query("SELECT n FROM t WHERE id = 9"),
        lambda tx: (ROWS + m.command_complete("SELECT 2") + rfq(tx) + rfq(tx), tx),
    ),
    "set": (
        m.query("SET application_name = 'other'"),
        lambda tx: (PARAMETER + m.command_complete("SET") + rfq(tx), tx),
    ),
    "set_work_mem": (
        m.query("SET work_mem = '64MB'"),
        lambda tx: (m.command_complete("SET") + rfq(tx), tx),
    ),
    "discard": (
        m.query("DISCARD ALL"),
        lambda tx: (m.command_complete("DISCARD ALL") + rfq("I"), "I"),
    ),
    "extended": (
        extended("SELECT n FROM t WHERE id = $1"),
        lambda tx: (
            PARSE_COMPLETE + BIND_COMPLETE + ROWS + m.command_complete("SELECT 2") + rfq(tx),
            tx,
        ),
    ),
    # Extended-protocol messages with no Sync yet: the server owes nothing.
    "unsynced": (extended("SELECT n FROM t WHERE id = $1")[:-5], lambda tx: (b"", tx)),
    # Session state that pins a hybrid client to its server.
    "listen": (m.query("LISTEN jobs"), lambda tx: (m.command_complete("LISTEN") + rfq(tx), tx)),
    "pipeline": (
        m.query("SELECT n FROM t WHERE id = 1") + m.query("SELECT n FROM t WHERE id = 2"),
        lambda tx: (
            (ROWS + m.command_complete("SELECT 2") + rfq(tx)) * 2,
            tx,
        ),
    ),
}


class Rig:
    """One pool (size 2, both servers up and idle) and three clients."""

    def __init__(self, mode: str, observe: bool, fast: bool, reset_always: bool = False) -> None:
        config = Config.model_validate(
            {
                "database_url": "postgres://app:pw@127.0.0.1:5432/app",
                "pool": {"mode": mode, "size": 2, "server_reset_query_always": reset_always},
                "observability": {"fingerprinting": observe},
            }
        )
        self.fast = fast
        self.proxy = Proxy(config)
        self.pool = self.proxy.pool_for(self.proxy.targets["app"], "app", "pw")
        self.pool.welcome = {}
        self.records: list[tuple[Any, ...]] = []
        self.servers = []
        for _ in range(2):
            server = ServerConnection(self.pool)
            server.transport = Recorder()
            server.state = IDLE
            server.observe = self.records.append
            self.pool.servers.add(server)
            self.pool.idle.append(server)
            self.servers.append(server)
        self.clients = []
        for _ in range(3):
            client = ClientConnection(self.proxy)
            client.transport = Recorder()
            client.state = READY
            client.pool = self.pool
            client.stats = self.pool.stats
            client.transaction_pooling = mode != "session"
            if mode == "hybrid" or not observe:
                client.tracker = SessionTracker(client.id, pinning=mode == "hybrid")
            else:
                client.tracker = TransactionTracker(client.id)
            client.observed = observe
            self.clients.append(client)

    def client_sends(self, i: int, data: bytes) -> None:
        client = self.clients[i]
        (client.data_received if self.fast else client._data_received)(data)

    def server_sends(self, j: int, data: bytes) -> None:
        server = self.servers[j]
        (server.data_received if self.fast else server._data_received)(data)

    def snapshot(self) -> dict[str, Any]:
        """Everything the relay keeps, with connections named by their index."""
        index = {id(x): n for n, x in enumerate(self.servers)}
        cindex = {id(x): n for n, x in enumerate(self.clients)}
        named = {c.id: n for n, c in enumerate(self.clients)}
        stats = self.pool.stats
        return {
            "clients": [
                (
                    c.state, c.ordinal, c.answered, c.parked, index.get(id(c.server)),
                    [(k, t) for k, t, _ in c.inflight], c.unanswered is None, len(c._queue),
                    bool(c.waiting_since), c._unsynced, c._unnamed_open, c.pins,
                    c._syncs_since_execute, c._early_syncs, c._retried,
                    bytes(c.transport.data), c.params, c.tracker.work,
                )
                for c in self.clients
            ],
            "servers": [
                (
                    s.state, s.pending, s.tx_status, s.last_tag, s.swallow, s.sqlstate,
                    cindex.get(id(s.client)), s.desynced, bool(s.xact_mark), s.copy,
                    s.statements.segments_sent, s.statements.segments_done,
                    bytes(s.transport.data), s.applied,
                )
                for s in self.servers
            ],
            "pool": (
                [index[id(s)] for s in self.pool.idle],
                [cindex[id(c)] for c in self.pool.parked],
                [cindex[id(c)] for c in self.pool.waiters],
                self.pool.waits, stats.server_assignment_count, stats.xact_count, stats.query_count,
                stats.received, stats.sent, stats.xact_time > 0, stats.query_time > 0,
            ),
            "records": [
                (named[r[0].client_id] if r[0] else None, r[1], r[6], r[7], r[8], r[2] <= r[5])
                for r in self.records
            ],
        }  # fmt: skip


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.AbstractEventLoop]:
    # (A client leaving mid-query cancels it; its server is closed either way.)
    monkeypatch.setattr(ServerConnection, "send_cancel", lambda server: None)
    with offline_loop(monkeypatch) as loop:
        yield loop


# A step: a client sends a request, or leaves, or a client's server answers its
# oldest request in one chunk or cut at a fraction of its length.
steps = st.lists(
    st.tuples(
        st.sampled_from(["send", "send", "send", "answer", "answer", "answer", "leave"]),
        st.integers(0, 2),
        st.sampled_from(sorted(REQUESTS)),
        st.one_of(st.none(), st.floats(0.01, 0.99)),
    ),
    min_size=1,
    max_size=40,
)


def drive(rigs: list[Rig], script: list[tuple[str, int, str, float | None]]) -> None:
    owed: list[list[str]] = [[] for _ in range(3)]  # requests each client awaits
    status = ["I"] * 3  # each client's transaction block status, as PostgreSQL has it
    for action, i, name, cut in script:
        if action == "leave":  # the client's Terminate: its server is released or closed
            for rig in rigs:
                rig.client_sends(i, m.terminate())
            owed[i].clear()
        elif action == "send":
            for rig in rigs:
                rig.client_sends(i, REQUESTS[name][0])
            owed[i].append(name)
        else:
            server = rigs[0].clients[i].server
            if server is None or not owed[i] or server.pending <= 0:
                continue
            j = rigs[0].servers.index(server)
            answer, status[i] = REQUESTS[owed[i].pop(0)][1](status[i])
            pieces = [answer]
            if cut is not None:
                at = max(1, int(len(answer) * cut))
                pieces = [answer[:at], answer[at:]]
            for piece in filter(None, pieces):
                for rig in rigs:
                    rig.server_sends(j, piece)
        first, *others = (rig.snapshot() for rig in rigs)
        for other in others:
            assert other == first, (action, i, name, cut)


@pytest.mark.parametrize(
    ("mode", "observe"),
    [("transaction", True), ("transaction", False), ("hybrid", True), ("session", True)],
)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=steps)
def test_fast_paths_do_what_the_python_relay_does(
    loop: asyncio.AbstractEventLoop, mode: str, observe: bool, script: list[Any]
) -> None:
    async def run() -> None:  # (inside the loop: a session-mode reset arms a timer)
        drive([Rig(mode, observe, fast=True), Rig(mode, observe, fast=False)], script)

    loop.run_until_complete(run())


# Clients that leave when their server cannot simply go back to the pool:
# the compiled Terminate must leave those to ClientConnection._cleanup.
LEAVING = {
    "waiting": [("send", 0, "begin", None), ("send", 1, "begin", None), ("answer", 0, "", None),
                ("answer", 1, "", None), ("send", 2, "select", None), ("leave", 2, "", None),
                ("send", 0, "commit", None), ("answer", 0, "", None)],
    "unsynced": [("send", 0, "unsynced", None), ("leave", 0, "", None)],
    "pinned": [("send", 0, "listen", None), ("answer", 0, "", None), ("leave", 0, "", None)],
    "in_transaction": [("send", 0, "begin", None), ("answer", 0, "", None), ("leave", 0, "", None)],
    "at_rest": [("send", 0, "select", None), ("answer", 0, "", None), ("leave", 0, "", None),
                ("send", 1, "select", None), ("answer", 1, "", None)],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(LEAVING))
@pytest.mark.parametrize(
    ("mode", "reset_always"), [("transaction", False), ("hybrid", False), ("session", False),
                               ("transaction", True)]
)  # fmt: skip
def test_a_leaving_client_gives_its_server_back_as_the_python_relay_does(
    loop: asyncio.AbstractEventLoop, case: str, mode: str, reset_always: bool
) -> None:
    async def run() -> None:
        rigs = [Rig(mode, True, fast, reset_always) for fast in (True, False)]
        drive(rigs, LEAVING[case])

    loop.run_until_complete(run())


def test_the_fast_paths_serve_plain_transactions(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pgbench -S transaction never reaches the Python relay."""
    rig = Rig("transaction", observe=True, fast=True)
    slow: list[str] = []
    monkeypatch.setattr(ClientConnection, "_data_received", lambda self, d: slow.append("c"))
    monkeypatch.setattr(ServerConnection, "_data_received", lambda self, d: slow.append("s"))
    rig.servers[0].state = rig.servers[1].state = IDLE
    client = rig.clients[0]
    server = rig.pool.acquire_nowait()
    assert server is not None
    client._link(server)
    for n in range(100):
        client.data_received(m.query(f"SELECT abalance FROM pgbench_accounts WHERE aid = {n}"))
        server.data_received(ROWS + m.command_complete("SELECT 2") + rfq("I"))
    assert slow == []
    assert (client.ordinal, client.answered, server.pending) == (100, 100, 0)
    assert client.parked and rig.pool.stats.xact_count == 100
    assert [r[6] for r in rig.records] == [b"SELECT 2\x00"] * 100


def test_records_stay_out_of_the_cycle_collector(loop: asyncio.AbstractEventLoop) -> None:
    """Records and inflight entries are untracked, share equal times and tags."""
    rig = Rig("transaction", observe=True, fast=True)
    client = rig.clients[0]
    for n in range(3):
        client.data_received(m.query(f"SELECT {n}"))
        assert not gc.is_tracked(client.inflight[0])
        client.server.data_received(ROWS + m.command_complete("SELECT 2") + rfq("I"))
    client.data_received(m.query("SELECT 3"))
    client.server.data_received(m.command_complete("SELECT 12") + rfq("I"))
    records = rig.records
    assert [r[6] for r in records] == [b"SELECT 2\x00"] * 3 + [b"SELECT 12\x00"]
    assert records[0][6] is records[1][6] is records[2][6]
    assert not any(gc.is_tracked(r) for r in records)
    assert all(r[3] is r[4] for r in records)
    # Linked before its first query: acquired when the query arrived.
    assert records[1][2] is records[1][3]


def test_compiled_clients_are_numbered_c1_c2_and_on() -> None:
    """The compiled ClientCore writes its own client ids: "c" and the next
    number in decimal, one apart, across a carry into the next digit."""
    rig = Rig("transaction", observe=True, fast=True)
    ids = [ClientConnection(rig.proxy).id for _ in range(11)]  # crosses a multiple of 10
    numbers = [int(i[1:]) for i in ids]
    assert all(type(i) is str and i == f"c{n}" for i, n in zip(ids, numbers, strict=True))
    assert numbers == list(range(numbers[0], numbers[0] + 11))
    assert numbers[0] > int(rig.clients[-1].id[1:])  # after the rig's own clients


def test_stateless_queries_skip_the_session_tracker(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observability off: the relay classifies only what may change session state."""
    rig = Rig("transaction", observe=False, fast=True)
    asked: list[bytes] = []
    monkeypatch.setattr(SessionTracker, "on_query", lambda self, body, n: asked.append(body))
    client = rig.clients[0]
    assert type(client.tracker) is SessionTracker
    for n in range(20):
        client.data_received(m.query(f"SELECT abalance FROM pgbench_accounts WHERE aid = {n};"))
        client.server.data_received(ROWS + m.command_complete("SELECT 2") + rfq("I"))
    assert asked == []
    client.data_received(m.query("SET search_path = app"))
    assert asked == [b"SET search_path = app\x00"]


def test_a_parked_server_is_taken_without_python(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no idle server, the next client takes the longest-parked client's."""
    rig = Rig("transaction", observe=True, fast=True)
    python: list[str] = []
    monkeypatch.setattr(type(rig.pool), "acquire_nowait", lambda pool: python.append("acquire"))
    first, second, third = rig.clients
    for _ in range(2):  # parks from its second transaction on, while a server is spare
        first.data_received(m.query("SELECT 1"))
        first.server.data_received(ROWS + m.command_complete("SELECT 2") + rfq("I"))
    kept = first.server
    assert first.parked and list(rig.pool.parked) == [first]
    second.data_received(m.query("BEGIN"))  # takes the idle server and keeps it
    second.server.data_received(m.command_complete("BEGIN") + rfq("T"))
    assert not rig.pool.idle
    third.data_received(m.query("SELECT 2"))
    assert third.server is kept and first.server is None and not first.parked
    assert not rig.pool.parked and python == []
    assert kept.transport.data.endswith(m.query("SELECT 2"))


def test_a_reloaded_server_check_delay_reaches_the_fast_acquire(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay takes an idle server itself only while it was used within
    server_check_delay; a reload's new delay applies to the pools it keeps."""
    rig = Rig("transaction", observe=True, fast=True)
    python: list[str] = []
    monkeypatch.setattr(type(rig.pool), "acquire_nowait", lambda pool: python.append("acquire"))
    for server in rig.servers:
        server.last_used = rig.proxy.clock - 10  # idle 10 s: within the default 30 s
    first, second, _ = rig.clients
    first.data_received(m.query("SELECT 1"))
    assert first.server is rig.servers[1] and python == []
    timeouts = rig.proxy.config.timeouts.model_copy(update={"server_check_delay": 5})
    rig.proxy.apply_config(rig.proxy.config.model_copy(update={"timeouts": timeouts}))
    assert rig.pool.check_delay == 5
    second.data_received(m.query("SELECT 2"))  # idle 10 s > 5 s: the pool checks it first
    assert python == ["acquire"] and second.server is None
    assert list(rig.pool.idle) == [rig.servers[0]]


@pytest.mark.parametrize("fast", [True, False])
def test_the_record_that_makes_drain_at_wakes_the_drain(
    loop: asyncio.AbstractEventLoop, fast: bool
) -> None:
    """The server whose record brings the observatory's queue to drain_at
    wakes the drain, once; the records before and after it do not."""
    rig = Rig("transaction", observe=True, fast=fast)
    observatory = rig.proxy.observatory
    woken: list[int] = []
    for server in rig.servers:
        server.observe = observatory.record
        server.drain_at = 3
        server.wake_drain = lambda: woken.append(len(observatory.queue))
    for n in range(7):
        rig.client_sends(0, m.query(f"SELECT {n}"))
        server = rig.clients[0].server
        (server.data_received if fast else server._data_received)(
            ROWS + m.command_complete("SELECT 2") + rfq("I")
        )
    assert woken == [3] and len(observatory.queue) == 7
