"""server_fast_close: a reload that changes a database takes its servers
from the sessions that hold them once no transaction is open on them,
instead of leaving each to the end of its session.

The reload points database_url at ``localhost`` instead of ``127.0.0.1``: the
same PostgreSQL, but a changed connection, so the old pool's servers must go.
The PgBouncer console's RECONNECT does the same and is run against PgBouncer
itself in test_pgbouncer_compat.py.
"""

from __future__ import annotations

import signal

import psycopg
import pytest


def reload_to_localhost(proxy, pg, wait_until) -> None:
    proxy.update_config({"database_url": pg.url().replace("127.0.0.1", "localhost")})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")


def backend_pid(conn: psycopg.Connection) -> int:
    row = conn.execute("select pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("fast_close", [False, True], ids=["default", "server_fast_close"])
def test_sessions_lose_their_server_between_transactions(
    pg, scry_proxy, wait_until, fast_close: bool
) -> None:
    pool = {"mode": "session", "size": 4, "server_fast_close": fast_close}
    proxy = scry_proxy({"pool": pool})
    idle = psycopg.connect(proxy.dsn(), autocommit=True)
    idle_pid = backend_pid(idle)
    busy = psycopg.connect(proxy.dsn())  # (not autocommit: a transaction is open)
    busy.execute("create temp table kept (x int)")

    reload_to_localhost(proxy, pg, wait_until)

    # The open transaction is never cut short: it goes on and commits.
    busy.execute("insert into kept values (1)")
    busy.commit()
    if not fast_close:  # both sessions keep their servers until they end
        assert backend_pid(idle) == idle_pid
        assert busy.execute("select count(*) from kept").fetchone() == (1,)
    else:  # ... here both lost them: the idle one at once, the other at COMMIT
        for conn in (idle, busy):
            with pytest.raises(psycopg.OperationalError):
                conn.execute("select 1")
        # (libpq reports the closed connection; the FATAL's words are in the log,
        # once for each server and once for each session.)
        log = proxy.log_text()
        assert log.count("terminating the session: database configuration changed") == 2, log
        assert log.count('reason="database configuration changed (server_fast_close)') == 2
    idle.close()
    busy.close()
    with psycopg.connect(proxy.dsn()) as fresh:  # served by the new config's pool
        assert fresh.execute("select 1").fetchone() == (1,)


def test_a_pinned_hybrid_client_moves_on_or_ends(pg, scry_proxy, wait_until) -> None:
    proxy = scry_proxy({"pool": {"mode": "hybrid", "size": 4, "server_fast_close": True}})
    # SET pins the client, but its state can be replayed on a new server.
    movable = psycopg.connect(proxy.dsn(), autocommit=True)
    movable.execute("set work_mem = '7MB'")
    old_pid = backend_pid(movable)
    # A temp table cannot move: that session ends.
    stuck = psycopg.connect(proxy.dsn(), autocommit=True)
    stuck.execute("create temp table stays (x int)")

    reload_to_localhost(proxy, pg, wait_until)

    assert movable.execute("show work_mem").fetchone() == ("7MB",)
    assert backend_pid(movable) != old_pid
    with pytest.raises(psycopg.OperationalError, match="server_fast_close"):
        stuck.execute("select 1")
    movable.close()
    stuck.close()
