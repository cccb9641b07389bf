"""Several hosts for one database (libpq's URL syntax, PgBouncer's host lists).

The session's one PostgreSQL plays every host: directly, and through
:class:`Hop`, a TCP forwarder on a port of its own that counts the
connections it carries and can stop listening, like a host going down. A
free port nobody listens on is a host that is down from the start. For
target_session_attrs, a real hot standby of it (``DevCluster.standby``)
plays the standby.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack

import psycopg
import psycopg.errors
import pytest

from scry.devcluster import DevCluster, free_port
from tests.integration.conftest import wait_until
from tests.integration.test_admin_api import get, start_admin_proxy
from tests.integration.test_wire_cancel import Sleeper, running


class Hop:
    """A TCP forwarder to PostgreSQL: another address for the same server."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.listen()

    def _run(self, coro) -> None:  # type: ignore[no-untyped-def]
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def listen(self) -> None:
        async def start() -> None:
            self._server = await asyncio.start_server(self._carry, "127.0.0.1", self.port)

        self._run(start())

    def go_down(self) -> None:
        """Stop listening and cut every connection carried so far."""

        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for writer in self._writers:
                writer.transport.abort()
            self._writers.clear()
            await self._server.wait_closed()

        self._run(stop())

    def close(self) -> None:
        if self._server is not None and self._server.is_serving():
            self.go_down()

        async def finish() -> None:
            carried = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in carried:
                task.cancel()
            await asyncio.gather(*carried, return_exceptions=True)

        self._run(finish())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except ConnectionError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.fixture
def hops(pg) -> Iterator[list[Hop]]:
    with ExitStack() as stack:
        made = []
        for _ in range(2):
            hop = Hop(pg.port)
            stack.callback(hop.close)
            made.append(hop)
        yield made


def url(*ports: int, query: str = "") -> str:
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    return f"postgresql://app:app_pass@{hosts}/app{query}"


def servers_taken(proxy, base: str, count: int) -> Counter[str]:
    """The hosts (``addr``) of ``count`` servers that ``count`` clients hold at once,
    each in a transaction; the clients then leave (and their servers close)."""
    clients = []
    try:
        for _ in range(count):
            conn = psycopg.connect(**proxy.conninfo())
            clients.append(conn)
            assert conn.execute("select 42").fetchone() == (42,)  # (the transaction stays open)
        return Counter(server["addr"] for server in get(base, "/api/v1/servers")["servers"])
    finally:
        for conn in clients:
            conn.close()


def unreachable_tries(proxy) -> list[str]:
    return [line for line in proxy.log_text().splitlines() if "server host unreachable" in line]


def test_a_host_that_is_down_costs_no_client_an_error(pg, scry_proxy, hops) -> None:
    dead = free_port()
    proxy, base = start_admin_proxy(
        scry_proxy, database_url=url(dead, hops[0].port), pool={"mode": "transaction", "size": 4}
    )
    # Every server went to the live host; each try of the dead one was logged, once.
    assert servers_taken(proxy, base, 4) == {f"127.0.0.1:{hops[0].port}": 4}
    assert hops[0].accepted == 4
    tries = unreachable_tries(proxy)
    assert tries and all(f"port={dead}" in line for line in tries)
    assert len(tries) <= 4  # (round-robin starts at the dead host every other time)


def test_round_robin_spreads_servers_over_hosts(pg, scry_proxy, hops) -> None:
    proxy, base = start_admin_proxy(
        scry_proxy,
        database_url=url(hops[0].port, hops[1].port),
        pool={"mode": "transaction", "size": 6},
    )
    assert servers_taken(proxy, base, 6) == {
        f"127.0.0.1:{hops[0].port}": 3,
        f"127.0.0.1:{hops[1].port}": 3,
    }
    assert (hops[0].accepted, hops[1].accepted) == (3, 3)


def test_disable_stays_on_a_host_until_it_fails(pg, scry_proxy, hops) -> None:
    first, second = hops
    proxy, base = start_admin_proxy(
        scry_proxy,
        database_url=url(first.port, second.port, query="?load_balance_hosts=disable"),
        pool={"mode": "transaction", "size": 3},
    )
    assert servers_taken(proxy, base, 3) == {f"127.0.0.1:{first.port}": 3}
    assert second.accepted == 0
    # The first host goes down: new servers go to the second...
    first.go_down()
    assert servers_taken(proxy, base, 3) == {f"127.0.0.1:{second.port}": 3}
    # ... and stay there when the first comes back.
    first.listen()
    accepted = first.accepted
    assert servers_taken(proxy, base, 3) == {f"127.0.0.1:{second.port}": 3}
    assert first.accepted == accepted
    tries = unreachable_tries(proxy)
    assert tries and all(f"port={first.port}" in line for line in tries)


def test_a_reload_that_changes_the_host_list_moves_the_servers(pg, scry_proxy, hops) -> None:
    first, second = hops
    proxy, base = start_admin_proxy(
        scry_proxy, database_url=url(first.port), pool={"mode": "transaction", "size": 2}
    )
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as idle_after:
        assert idle_after.execute("select 1").fetchone() == (1,)  # (a server stays idle)
        assert servers_taken(proxy, base, 2)[f"127.0.0.1:{first.port}"] == 2
        new_list = url(second.port, first.port, query="?load_balance_hosts=disable")
        proxy.update_config({"database_url": new_list})
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
        # The servers of the old list are retired; new ones start at the new list's head.
        assert servers_taken(proxy, base, 2) == {f"127.0.0.1:{second.port}": 2}
        assert idle_after.execute("select 2").fetchone() == (2,)


def test_a_cancel_goes_to_the_host_its_server_is_on(pg, scry_proxy, hops) -> None:
    # The first host is down, so the server is on the second: a CancelRequest
    # sent to the first host of the list would be lost.
    proxy = scry_proxy({"database_url": url(free_port(), hops[0].port)})
    sleeper = Sleeper(proxy, "select pg_sleep(30) /* host_list_cancel */").start()
    try:
        wait_until(lambda: running(pg, "host_list_cancel") == 1, 5, what="the query")
        carried = hops[0].accepted
        sleeper.conn.cancel_safe(timeout=5)
        assert isinstance(sleeper.join(5), psycopg.errors.QueryCanceled), sleeper.outcome
        assert hops[0].accepted == carried + 1  # (the CancelRequest's own connection)
    finally:
        sleeper.close()


# --- target_session_attrs: a real hot standby of the session's cluster --------------------


@pytest.fixture(scope="module")
def standby(pg) -> Iterator[DevCluster]:
    replica = pg.standby()
    yield replica
    replica.stop()


@pytest.mark.parametrize(
    ("attrs", "taken"),
    [
        ("primary", ["primary", "primary"]),
        ("read-write", ["primary", "primary"]),
        ("standby", ["standby", "standby"]),
        ("read-only", ["standby", "standby"]),
        ("prefer-standby", ["standby", "standby"]),
        ("any", ["primary", "standby"]),  # (round-robin over both)
    ],
)
def test_target_session_attrs_chooses_the_kind_of_server(
    pg, standby, scry_proxy, attrs: str, taken: list[str]
) -> None:
    ports = {"primary": pg.port, "standby": standby.port}
    proxy, base = start_admin_proxy(
        scry_proxy,
        database_url=url(standby.port, pg.port, query=f"?target_session_attrs={attrs}"),
        pool={"mode": "transaction", "size": 2},
    )
    assert servers_taken(proxy, base, 2) == Counter(f"127.0.0.1:{ports[k]}" for k in taken)


def test_prefer_standby_takes_a_primary_when_there_is_no_standby(pg, scry_proxy) -> None:
    proxy, base = start_admin_proxy(
        scry_proxy,
        database_url=url(pg.port, query="?target_session_attrs=prefer-standby"),
        pool={"mode": "transaction", "size": 2},
    )
    assert servers_taken(proxy, base, 2) == {f"127.0.0.1:{pg.port}": 2}


def test_no_server_of_the_wanted_kind_is_a_clear_error(standby, scry_proxy) -> None:
    proxy = scry_proxy(
        {"database_url": url(standby.port, query="?target_session_attrs=read-write")}
    )
    with pytest.raises(psycopg.OperationalError, match="target_session_attrs=read-write"):
        psycopg.connect(**proxy.conninfo())
    assert "server closed" in proxy.log_text()  # (the standby's server, as it did not fit)
