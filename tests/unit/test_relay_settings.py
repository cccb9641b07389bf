"""A server's answer to the settings scry applies for a newly linked client
(ServerConnection._apply_settings) is not the client's.

Its CommandComplete must not complete the client's Execute, queued behind
it. It did: the statement was recorded as a success with scry's tag, and the
client's ErrorResponse then found nothing left to record. CI saw it once,
as a division by zero counted as a success (test_observe_truth).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fake_transport import Recorder, msg, offline_loop

from scry.client import READY, ClientConnection
from scry.config import Config
from scry.hybrid import TransactionTracker
from scry.protocol import messages as m
from scry.proxy import Proxy
from scry.server import IDLE, ServerConnection, settings_sql

PARSE_COMPLETE = msg(b"1")
DIVISION_BY_ZERO = m.error_response("22012", "division by zero")


def extended(text: str) -> bytes:
    return (
        msg(b"P", b"\x00" + text.encode() + b"\x00\x00\x00")
        + msg(b"B", b"\x00\x00\x00\x00\x00\x00\x00\x00")
        + msg(b"E", b"\x00\x00\x00\x00\x00")
        + msg(b"S")
    )


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.AbstractEventLoop]:
    with offline_loop(monkeypatch) as loop:
        yield loop


@pytest.mark.parametrize("split", [False, True], ids=["one chunk", "two chunks"])
def test_an_injected_set_does_not_complete_the_clients_execute(
    loop: asyncio.AbstractEventLoop, split: bool
) -> None:
    config = Config.model_validate(
        {"database_url": "postgres://app:pw@127.0.0.1:5432/app", "pool": {"size": 1}}
    )
    proxy = Proxy(config)
    pool = proxy.pool_for(proxy.targets["app"], "app", "pw")
    pool.welcome = {}
    records: list[tuple[Any, ...]] = []
    server = ServerConnection(pool)
    server.transport = backend = Recorder()
    server.state = IDLE
    server.applied = {}
    server.observe = records.append
    pool.servers.add(server)
    pool.idle.append(server)
    client = ClientConnection(proxy)
    client.transport = wire = Recorder()
    client.state = READY
    client.pool = pool
    client.stats = pool.stats
    client.tracker = TransactionTracker(client.id)
    client.observed = True
    client.params = {"application_name": "other"}  # not what the server has: a SET first

    client.data_received(extended("select 10 / $1::int"))
    assert b"set_config" in bytes(backend.data)  # scry's own, before the batch
    set_answer = (
        m.row_description([("set_config", 25)])
        + m.data_row(["other"])
        + m.command_complete("SELECT 1")
        + m.ready_for_query(ord("I"))
    )
    batch_answer = PARSE_COMPLETE + DIVISION_BY_ZERO + m.ready_for_query(ord("I"))
    if split:
        server.data_received(set_answer)
        server.data_received(batch_answer)
    else:
        server.data_received(set_answer + batch_answer)

    assert bytes(wire.data) == batch_answer  # the SET's answer is scry's
    assert len(records) == 1
    record = records[0]
    assert record[1].startswith(b"select 10 / $1::int")
    assert record[6] == b"" and record[7] == "22012"  # no tag, the client's error
    assert not client.inflight


def test_settings_sql_sets_what_differs_and_resets_what_is_gone() -> None:
    applied = {"TimeZone": "UTC", "search_path": "a", 'x.odd"; select 1; --': "1"}
    wanted = {"TimeZone": "UTC", "search_path": "it's", "app.tenant": "t\\1"}
    assert settings_sql(applied, wanted) == (
        "SELECT set_config('search_path', 'it''s', false),"
        " set_config('app.tenant', E't\\\\1', false)"
        ';RESET "x.odd""; select 1; --"'
    )
    assert settings_sql(wanted, wanted) == ""
