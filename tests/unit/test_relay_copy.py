"""COPY FROM STDIN and the ReadyForQuery count, with chunk timing pinned down.

PostgreSQL ignores a Sync it reads while in COPY and answers one it reads
after the COPY failed. Which one happened depends on when each side's bytes
arrive, which a real socket does not let a test choose; here a client and a
server connection are driven in-process with fake transports, chunk by chunk.
The same flows run against a real PostgreSQL in tests/integration/test_wire_copy.py.

The property: the server is never free for another client while PostgreSQL
still owes an answer, and is given back as soon as it owes none when that can
be known.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import pytest
from fake_transport import Recorder, msg

from scry.client import READY, ClientConnection
from scry.config import Config
from scry.hybrid import SessionTracker
from scry.pool import Pool
from scry.protocol import messages as m
from scry.proxy import Proxy
from scry.server import CLOSED, IDLE, ServerConnection


def kinds(data: bytes) -> str:
    out, pos = [], 0
    while pos < len(data):
        out.append(chr(data[pos]))
        pos += 1 + struct.unpack_from("!i", data, pos + 1)[0]
    return "".join(out)


SYNC, COPY_DONE = msg(b"S"), msg(b"c")
COPY_IN_RESPONSE = msg(b"G", b"\x00\x00\x01\x00\x00")
PARSE_BIND_EXECUTE = (
    msg(b"P", b"\x00copy t from stdin\x00\x00\x00")
    + msg(b"B", b"\x00\x00\x00\x00\x00\x00\x00\x00")
    + msg(b"E", b"\x00\x00\x00\x00\x00")
)
RFQ = m.ready_for_query()
ERROR = m.error_response("22P02", "invalid input syntax for type integer")


def data(payload: bytes) -> bytes:
    return msg(b"d", payload)


class Rig:
    """One pool with one server, room for another (so a client may park it);
    clients made on demand (transaction mode)."""

    def __init__(self, observe: bool) -> None:
        config = Config.model_validate(
            {
                "database_url": "postgres://app:pw@127.0.0.1:5432/app",
                "pool": {"mode": "transaction", "size": 2},
            }
        )
        self.proxy = Proxy(config)
        self.pool = self.proxy.pool_for(self.proxy.targets["app"], "app", "pw")
        self.pool.welcome = {}
        self.server = ServerConnection(self.pool)
        self.server.transport = self.backend = Recorder()
        self.server.state = IDLE
        self.pool.servers.add(self.server)
        self.pool.idle.append(self.server)
        self.observe = observe

    def client(self) -> tuple[ClientConnection, Recorder]:
        client = ClientConnection(self.proxy)
        client.transport = wire = Recorder()
        client.state = READY
        client.pool = self.pool
        client.stats = self.pool.stats
        client.tracker = SessionTracker(client.id, pinning=False)
        client.observed = self.observe
        return client, wire

    def free_for_others(self) -> bool:
        """Would another client get this server now?"""
        server = self.server
        if server in self.pool.idle:
            return True
        holder = server.client
        return holder is not None and holder.parked and server.clean


@pytest.fixture(params=[True, False], ids=["observed", "unobserved"])
def rig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    spawned: list[Pool] = []
    monkeypatch.setattr(Pool, "_spawn", lambda pool: spawned.append(pool))  # no PostgreSQL here
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield Rig(observe=request.param)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_sync_after_a_failing_row_is_answered_and_the_server_waits_for_it(rig: Rig) -> None:
    # The COPY fails on the row before PostgreSQL reads the Sync: two answers.
    # The server may not look free after the first, or the second would reach
    # whichever client got it next.
    a, a_wire = rig.client()
    a.data_received(m.query("copy t from stdin"))
    rig.server.data_received(COPY_IN_RESPONSE)
    a.data_received(data(b"x\n") + SYNC + COPY_DONE)  # scanned while the COPY is live
    rig.server.data_received(ERROR + RFQ)
    assert not rig.free_for_others()
    b, b_wire = rig.client()
    b.data_received(m.query("select 1"))
    assert b.server is None
    rig.server.data_received(RFQ)  # the Sync's answer
    assert kinds(a_wire.take()) == "GEZZ"
    assert b_wire.take() == b""
    assert rig.server.state is CLOSED  # answers out of step once: not reused
    assert b.server is None and b in rig.pool.waiters  # waits for a fresh server


def test_libpq_extended_copy_settles_exactly(rig: Rig) -> None:
    # Parse/Bind/Execute/Sync, data, CopyDone/Sync: PostgreSQL ignores the
    # first Sync (it is already in COPY) and answers only the last.
    a, a_wire = rig.client()
    a.data_received(PARSE_BIND_EXECUTE + SYNC)
    rig.server.data_received(msg(b"1") + msg(b"2") + COPY_IN_RESPONSE)
    a.data_received(data(b"1\n") + data(b"2\n"))
    a.data_received(COPY_DONE + SYNC)
    assert not rig.free_for_others()
    rig.server.data_received(m.command_complete("COPY 2") + RFQ)
    assert kinds(a_wire.take()) == "12GCZ"
    assert rig.server.pending == 0 and not rig.server.desynced
    assert rig.free_for_others()
    assert a.answered == a.ordinal and not a.inflight


def test_extended_copy_sent_in_one_go_settles_exactly(rig: Rig) -> None:
    # Everything before PostgreSQL says a word: the COPY starts after the scan.
    # (The client holds the server from its last transaction, as it usually does
    # from its second on.)
    a, a_wire = rig.client()
    for _ in range(2):
        a.data_received(m.query("select 1"))
        rig.server.data_received(m.command_complete("SELECT 1") + RFQ)
    assert a.parked and a.server is rig.server
    a.data_received(PARSE_BIND_EXECUTE + SYNC + data(b"1\n") + COPY_DONE + SYNC)
    rig.server.data_received(msg(b"1") + msg(b"2") + COPY_IN_RESPONSE)
    assert not rig.free_for_others()
    rig.server.data_received(m.command_complete("COPY 1") + RFQ)
    assert rig.server.pending == 0 and rig.free_for_others()
    assert a.answered == a.ordinal and not a.inflight


def test_extended_copy_that_fails_on_its_data_settles_exactly(rig: Rig) -> None:
    # libpq's Sync right after the Execute was read in COPY, before any data:
    # ignored, even though the COPY then failed on a row.
    a, a_wire = rig.client()
    a.data_received(PARSE_BIND_EXECUTE + SYNC)
    rig.server.data_received(msg(b"1") + msg(b"2") + COPY_IN_RESPONSE)
    a.data_received(data(b"x\n"))
    rig.server.data_received(ERROR)  # the failure comes back before CopyDone is sent
    a.data_received(COPY_DONE + SYNC)
    assert not rig.free_for_others()
    rig.server.data_received(RFQ)
    assert kinds(a_wire.take()) == "12GEZ"
    assert rig.server.pending == 0 and not rig.server.desynced
    assert rig.free_for_others()
    assert a.answered == a.ordinal and not a.inflight


def test_extended_copy_that_fails_before_copydone_is_scanned(rig: Rig) -> None:
    a, a_wire = rig.client()
    a.data_received(PARSE_BIND_EXECUTE + SYNC)
    rig.server.data_received(msg(b"1") + msg(b"2") + COPY_IN_RESPONSE)
    a.data_received(data(b"x\n") + COPY_DONE + SYNC)  # scanned while the COPY is live
    rig.server.data_received(ERROR)
    assert not rig.free_for_others()
    rig.server.data_received(RFQ)
    assert rig.server.pending == 0 and not rig.server.desynced and rig.free_for_others()


def test_messages_sent_into_a_copy_are_never_taken_for_ignored_syncs(rig: Rig) -> None:
    # An extended batch sent into a live COPY: PostgreSQL fails the COPY on
    # its Parse (08P01) and answers the batch's Sync. Nothing may be settled
    # as ignored; the server is not reused.
    a, a_wire = rig.client()
    a.data_received(m.query("copy t from stdin"))
    rig.server.data_received(COPY_IN_RESPONSE)
    a.data_received(PARSE_BIND_EXECUTE + SYNC + COPY_DONE)
    bogus = m.error_response("08P01", "unexpected message type 0x50 during COPY from stdin")
    rig.server.data_received(bogus + RFQ)
    assert not rig.free_for_others()  # the batch's Sync is still to be answered
    rig.server.data_received(m.error_response("26000", "unnamed prepared statement") + RFQ)
    assert rig.server.pending == 0 and rig.server.desynced
    assert not rig.free_for_others()
    # Its count can be high, never low: with nothing owed, a shutdown need not wait.
    assert a.between_transactions()


def test_copydone_for_a_statement_that_was_not_a_copy(rig: Rig) -> None:
    # A CopyDone outside COPY is ignored by PostgreSQL; both Syncs are answered.
    a, a_wire = rig.client()
    a.data_received(PARSE_BIND_EXECUTE + SYNC + COPY_DONE + SYNC)
    rig.server.data_received(msg(b"1") + msg(b"2") + m.command_complete("SELECT 1") + RFQ)
    assert not rig.free_for_others()
    rig.server.data_received(RFQ)
    assert rig.server.pending == 0 and rig.free_for_others()


def test_successful_simple_copy_with_a_sync_inside(rig: Rig) -> None:
    a, a_wire = rig.client()
    a.data_received(m.query("copy t from stdin"))
    rig.server.data_received(COPY_IN_RESPONSE)
    a.data_received(data(b"1\n") + SYNC + COPY_DONE)
    assert not rig.free_for_others()
    rig.server.data_received(m.command_complete("COPY 1") + RFQ)
    assert rig.server.pending == 0 and rig.free_for_others()
    assert a.answered == a.ordinal and not a.inflight


def test_stray_ready_for_query_on_an_idle_server_closes_it(rig: Rig) -> None:
    a, _ = rig.client()
    a.data_received(m.query("select 1"))
    rig.server.data_received(m.command_complete("SELECT 1") + RFQ)
    assert rig.free_for_others()
    rig.server.data_received(RFQ)
    assert rig.server.state is CLOSED
