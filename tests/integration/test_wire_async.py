"""Messages the server sends on its own: NoticeResponse, NotificationResponse,
ParameterStatus. Each must reach the client it belongs to, and only that one.

LISTEN needs a server that stays with its client: session mode, and hybrid
mode (where LISTEN pins the client). In transaction mode PgBouncer does not
support LISTEN either; it is not tested there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

MODES = ["session", "transaction", "hybrid"]


@pytest.fixture(scope="module")
def proxies(scry_proxy_module) -> Callable[[str], object]:
    cache: dict[str, object] = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = scry_proxy_module({"pool": {"mode": mode, "size": 3}})
        return cache[mode]

    return get


def connect(proxy, **kw) -> psycopg.Connection:
    return psycopg.connect(**proxy.conninfo(), autocommit=True, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_notices_reach_the_right_client(proxies, mode: str) -> None:
    # Five clients over three servers, each raising notices tagged with its id.
    proxy = proxies(mode)
    n_clients = 3 if mode == "session" else 5
    seen: dict[int, list[str]] = {i: [] for i in range(n_clients)}
    failures: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with connect(proxy) as conn:
                conn.add_notice_handler(lambda d, i=i: seen[i].append(d.message_primary))
                for j in range(10):
                    conn.execute(f"do $$ begin raise notice 'client % round %', {i}, {j}; end $$")
                    # and through the extended protocol, with a warning
                    conn.execute(
                        "select set_config('scry.x', %s, false)", (str(j),)
                    )  # no notice: must not produce one
                    conn.execute(f"do $$ begin raise warning 'client % warn %', {i}, {j}; end $$")
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures, failures
    for i, messages in seen.items():
        expected = []
        for j in range(10):
            expected += [f"client {i} round {j}", f"client {i} warn {j}"]
        assert messages == expected, (i, messages[:6])


@pytest.mark.parametrize("mode", ["session", "hybrid"])
def test_listen_notify(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    a, b, c = connect(proxy), connect(proxy), connect(proxy)
    try:
        a.execute("listen wire_ch_a")
        b.execute("listen wire_ch_b")
        # Some traffic in between, so that in hybrid mode servers change hands.
        for _ in range(5):
            c.execute("select 1")
        c.execute("notify wire_ch_a, 'to a'")
        c.execute("select pg_notify('wire_ch_b', 'to b')")
        # From outside scry, too.
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as d:
            d.execute("notify wire_ch_a, 'direct'")
        got_a = [(n.channel, n.payload) for n in a.notifies(timeout=5, stop_after=2)]
        got_b = [(n.channel, n.payload) for n in b.notifies(timeout=5, stop_after=1)]
        assert got_a == [("wire_ch_a", "to a"), ("wire_ch_a", "direct")]
        assert got_b == [("wire_ch_b", "to b")]
        # Nothing for the client that listens to nothing.
        assert list(c.notifies(timeout=0.3)) == []
        # A notification that arrives while the listener runs a query.
        c.execute("notify wire_ch_b, 'during'")
        b.execute("select pg_sleep(0.1)")
        assert [(n.channel, n.payload) for n in b.notifies(timeout=5, stop_after=1)] == [
            ("wire_ch_b", "during")
        ]
        a.execute("unlisten wire_ch_a")
        c.execute("notify wire_ch_a, 'too late'")
        assert list(a.notifies(timeout=0.3)) == []
    finally:
        for conn in (a, b, c):
            conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_parameter_status_follows_each_client(proxies, mode: str) -> None:
    proxy = proxies(mode)
    # (hybrid: a SET pins the client to its server, so no more clients than servers)
    n_clients = 5 if mode == "transaction" else 3
    conns = [connect(proxy) for _ in range(n_clients)]
    try:
        zones = ["UTC", "Asia/Tokyo", "America/New_York", "Europe/Paris", "Australia/Sydney"]
        for i, conn in enumerate(conns):
            conn.execute(f"set application_name = 'wire-client-{i}'")
            conn.execute(f"set timezone = '{zones[i]}'")
            assert conn.info.parameter_status("application_name") == f"wire-client-{i}"
            assert conn.info.parameter_status("TimeZone") == zones[i]
        for _round in range(3):
            for i, conn in enumerate(conns):
                row = conn.execute(
                    "select current_setting('application_name'), current_setting('timezone')"
                ).fetchone()
                assert row == (f"wire-client-{i}", zones[i]), (mode, i, row)
        # A SET inside a rolled-back transaction is undone, and the client is told.
        conn = conns[0]
        with conn.transaction(force_rollback=True):
            conn.execute("set application_name = 'rolled-back'")
            assert conn.info.parameter_status("application_name") == "rolled-back"
        assert conn.info.parameter_status("application_name") == "wire-client-0"
        assert conn.execute("show application_name").fetchone() == ("wire-client-0",)
    finally:
        for conn in conns:
            conn.close()
