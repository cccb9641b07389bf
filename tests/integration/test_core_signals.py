"""Signals and logs: SIGHUP reload, SIGTERM drain, a second SIGTERM, log lines."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
import uuid

import psycopg
import pytest


def connect(proxy, dbname: str = "app", autocommit: bool = True) -> psycopg.Connection:
    return psycopg.connect(
        **proxy.conninfo(dbname=dbname), autocommit=autocommit, prepare_threshold=None
    )


def can_connect_tcp(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# --- SIGHUP --------------------------------------------------------------------------------


def test_sighup_adds_database_and_resizes_pool(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy(
        {"pool": {"mode": "transaction", "size": 1}, "timeouts": {"query_wait_timeout": 2}}
    )
    holder = connect(proxy, autocommit=False)
    idle = connect(proxy)
    try:
        assert holder.execute("select 1").fetchone() == (1,)  # holds the only server
        with pytest.raises(psycopg.OperationalError, match="no such database"):
            connect(proxy, dbname="app2")

        proxy.update_config(
            {"pool": {"size": 3}, "databases": {"app2": {"database_url": pg.url()}}}
        )
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")

        # The new database is reachable without a restart.
        with connect(proxy, dbname="app2") as conn:
            assert conn.execute("select current_database()").fetchone() == ("app",)
        # The bigger pool applies to the running pool: while holder keeps its
        # transaction open, two more transactions get servers (size 1 would time out).
        others = [connect(proxy, autocommit=False) for _ in range(2)]
        try:
            for i, conn in enumerate(others):
                assert conn.execute("select %s::int", (i,)).fetchone() == (i,)
        finally:
            for conn in others:
                conn.close()
        # Existing connections stayed up, with their transaction intact.
        assert holder.execute("select txid_current_if_assigned() is null").fetchone() == (True,)
        holder.commit()
        assert idle.execute("select 'idle ok'").fetchone() == ("idle ok",)
    finally:
        holder.close()
        idle.close()
    assert proxy.returncode is None  # never restarted


def test_sighup_applies_a_new_log_level(scry_proxy, wait_until) -> None:
    proxy = scry_proxy({"log": {"level": "warning"}})
    with connect(proxy) as conn:
        conn.execute("select 1")
    proxy.update_config({"log": {"level": "info"}})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
    assert "client login" not in proxy.log_text()  # (at warning, before the reload)
    with connect(proxy) as conn:
        conn.execute("select 2")
    wait_until(lambda: "client login" in proxy.log_text(), 5, what="the login's line")


def test_sighup_moving_a_database_carries_its_clients_over(scry_proxy, pg, wait_until) -> None:
    # A reload that changes where a database lives retires the old pool; a
    # client logged in before it gets its next server from the new one. (It
    # used to wait forever while the old pool opened and closed servers.)
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2}})
    with connect(proxy) as before, connect(proxy, autocommit=False) as busy:
        assert before.execute("select 1").fetchone() == (1,)
        assert busy.execute("select 1").fetchone() == (1,)  # (holds a server of the old pool)
        proxy.update_config({"database_url": pg.url(application_name="moved")})
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
        row = before.execute("select current_setting('application_name')").fetchone()
        assert row == ("moved",)
        busy.commit()  # (its old server closes on release)
        assert busy.execute("select 2").fetchone() == (2,)
    opened = proxy.log_text().count("server connected")
    assert opened <= 4, f"{opened} servers opened for two clients"


def test_sighup_moving_a_database_stops_its_old_pools_min_size(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2, "min_size": 2}})
    with connect(proxy) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    wait_until(lambda: proxy.log_text().count("server connected") >= 2, 5, what="min_size")
    proxy.update_config({"database_url": pg.url(application_name="moved")})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
    # No event tells that nothing happens: watch three janitor passes (1 s
    # apart). The old pool used to open min_size servers at each, which its
    # staleness closed at once.
    time.sleep(3.5)
    assert proxy.log_text().count("server connected") == 2
    with connect(proxy) as conn:  # (the new pool keeps min_size from its first login)
        assert conn.execute("select 2").fetchone() == (2,)


def test_sighup_removing_a_database_fails_its_waiting_clients(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy({"databases": {"other": {"database_url": pg.url()}}})
    with connect(proxy, dbname="other") as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        proxy.update_config({"databases": None})
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
        with pytest.raises(psycopg.OperationalError, match='database "other" changed on reload'):
            conn.execute("select 2")
    with connect(proxy) as conn:  # (the other database carries on)
        assert conn.execute("select 3").fetchone() == (3,)


def test_sighup_with_broken_config_keeps_running(scry_proxy, wait_until) -> None:
    proxy = scry_proxy()
    with connect(proxy) as conn:
        proxy.config_path.write_text("pool: [this is not, a mapping\n")
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload failed" in proxy.log_text(), 5, what="reload failed")
        assert conn.execute("select 1").fetchone() == (1,)
    with connect(proxy) as conn:
        assert conn.execute("select 2").fetchone() == (2,)


# --- SIGTERM ---------------------------------------------------------------------------------


def test_sigterm_drains_open_transaction(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy()
    table = f"scry_drain_{uuid.uuid4().hex[:8]}"
    conn = connect(proxy, autocommit=False)
    try:
        conn.execute(f"create table {table} (x int)")
        conn.execute(f"insert into {table} values (1)")

        proxy.send_signal(signal.SIGTERM)
        # New connections are refused (the listener is closed).
        wait_until(lambda: not can_connect_tcp(proxy.port), 5, what="the listener to close")
        assert proxy.returncode is None, "exited with a transaction still open"

        # The open transaction can still work and COMMIT.
        conn.execute(f"insert into {table} values (2)")
        conn.commit()
        # Then the proxy exits by itself, with status 0.
        assert proxy.wait(10) == 0
    finally:
        conn.close()
    assert pg.psql(f"select sum(x) from {table}") == "3"
    pg.psql(f"drop table {table}")


def test_sigterm_closes_idle_clients_and_exits(scry_proxy) -> None:
    proxy = scry_proxy()
    conn = connect(proxy)
    try:
        assert conn.execute("select 1").fetchone() == (1,)
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(10) == 0
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
    finally:
        conn.close()


def test_second_sigterm_exits_immediately(scry_proxy) -> None:
    proxy = scry_proxy()  # shutdown_timeout 0: the drain alone would wait forever
    conn = connect(proxy, autocommit=False)
    try:
        assert conn.execute("select 1").fetchone() == (1,)  # transaction open
        proxy.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proxy.wait(0.5)  # draining: the open transaction keeps it alive
        started = time.monotonic()
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(3)
        assert time.monotonic() - started < 3
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
    finally:
        conn.close()
    assert "signal received again" in proxy.log_text()


# --- logs ------------------------------------------------------------------------------------


def test_one_log_line_per_connection_event(scry_proxy, wait_until) -> None:
    proxy = scry_proxy()
    marker = f"logmarker_{uuid.uuid4().hex[:8]}"
    n_clients, n_queries = 3, 30
    for c in range(n_clients):
        with psycopg.connect(
            **proxy.conninfo(),
            autocommit=True,
            prepare_threshold=None,
            application_name=f"logtest{c}",
        ) as conn:
            for i in range(n_queries):
                assert conn.execute(f"select %s::int /* {marker} */", (i,)).fetchone() == (i,)
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute(f"select 1/0 /* {marker} */")

    def lines() -> list[str]:
        return proxy.log_text().splitlines()

    def closed_lines() -> list[str]:
        return [ln for ln in lines() if "client closed" in ln and "user=app" in ln]

    wait_until(lambda: len(closed_lines()) >= n_clients, 5, what="client closed lines")
    logins = [ln for ln in lines() if "client login" in ln]
    assert len(logins) == n_clients, logins
    for c in range(n_clients):
        assert sum(f"app=logtest{c}" in ln for ln in logins) == 1, logins
    assert len(closed_lines()) == n_clients, closed_lines()
    for line in logins + closed_lines():
        assert re.search(r"\bclient=\S+", line) and "db=app" in line, line
    # Nothing per query: neither the SQL text nor one line per statement.
    text = proxy.log_text()
    assert marker not in text
    assert "division by zero" not in text
    assert len(lines()) < n_clients * 4 + 10, text


def test_log_queries_logs_each_statement_anonymized(scry_proxy, wait_until) -> None:
    """log.log_queries: a line per statement from the drain, literals never included."""
    proxy = scry_proxy({"log": {"log_queries": True}})
    secret = f"secret_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(**proxy.conninfo(), autocommit=True, application_name="lq") as conn:
        for _ in range(3):
            # (a number no port, pid or timestamp in the log can contain)
            row = conn.execute(f"select '{secret}' as s, 918273645 as n").fetchone()
            assert row == (secret, 918273645)
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("select 1/0")

    def query_lines() -> list[str]:
        return [ln for ln in proxy.log_text().splitlines() if " query " in ln]

    wait_until(lambda: len(query_lines()) >= 4, 5, what="four query lines")
    lines = query_lines()
    assert len(lines) == 4, lines
    assert all("db=app" in ln and "user=app" in ln and "app=lq" in ln for ln in lines), lines
    assert sum("sqlstate=22012" in ln for ln in lines) == 1, lines
    assert len({re.search(r"fingerprint=(\S+)", ln).group(1) for ln in lines[:3]}) == 1  # type: ignore[union-attr]
    text = proxy.log_text()
    assert secret not in text and "918273645" not in text


def test_stats_period_logs_a_stats_line_per_database_with_traffic(scry_proxy, wait_until) -> None:
    # PgBouncer's log_stats: rates and average times, once a period.
    proxy = scry_proxy({"log": {"stats_period": 1}})
    with connect(proxy) as conn:
        for _ in range(20):
            conn.execute("select 1")
        wait_until(lambda: "stats database=app" in proxy.log_text(), 5, what="a stats line")
    line = next(x for x in proxy.log_text().splitlines() if "stats database=app" in x)
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    assert float(fields["xacts_per_s"]) > 0 and float(fields["queries_per_s"]) > 0, line
    assert int(fields["in_bytes_per_s"]) > 0 and int(fields["out_bytes_per_s"]) > 0, line
    assert int(fields["query_us"]) > 0, line
