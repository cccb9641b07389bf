"""PAUSE / RESUME through the admin API, with PgBouncer's semantics.

PAUSE holds new queries, waits for the servers to finish what they run
(transactions in transaction/hybrid mode, sessions in session mode), then
closes the servers. RESUME lets the held queries run.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from typing import Any

import psycopg
import pytest

from scry.devcluster import free_port

TOKEN = "wire-pause-token"


def make_proxy(scry_proxy, mode: str, size: int = 2, **timeouts: float):
    port = free_port()
    proxy = scry_proxy(
        {
            "pool": {"mode": mode, "size": size},
            "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{port}", "token": TOKEN},
            "timeouts": {"query_wait_timeout": 30, **timeouts},
        }
    )
    proxy.admin_port = port
    return proxy


def admin_post(proxy, action: str, **query: Any) -> dict[str, Any]:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    req = urllib.request.Request(
        f"http://127.0.0.1:{proxy.admin_port}/api/v1/{action}" + (f"?{qs}" if qs else ""),
        method="POST",
        headers={"Authorization": f"Bearer {TOKEN}"},
        data=b"",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


class Background:
    """Run ``fn`` in a thread; ``result()`` waits for it."""

    def __init__(self, fn) -> None:
        self.value: list[Any] = []
        self.thread = threading.Thread(target=lambda: self.value.append(self._call(fn)))
        self.thread.start()

    @staticmethod
    def _call(fn) -> Any:
        try:
            return fn()
        except BaseException as exc:  # handed to the test
            return exc

    @property
    def done(self) -> bool:
        return bool(self.value)

    def result(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert self.value, "still running"
        return self.value[0]


def connect(proxy, **kw: Any) -> psycopg.Connection:
    kw.setdefault("autocommit", True)
    return psycopg.connect(**proxy.conninfo(), **kw)


def live_backends(pg, proxy) -> int:
    pids = [int(p) for p in re.findall(r"backend_pid=(\d+)", proxy.log_text())]
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity where pid = any(%s)", (pids,)
        ).fetchone()
    return int(row[0]) if row else 0


def wait_for(predicate, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return result


@pytest.mark.parametrize("mode", ["transaction", "hybrid"])
def test_pause_waits_for_the_transaction_and_holds_new_queries(scry_proxy, pg, mode: str) -> None:
    proxy = make_proxy(scry_proxy, mode)
    a = connect(proxy, autocommit=False)
    b = connect(proxy)
    try:
        b.execute("select 1")  # logged in and served once before the pause
        a.execute("select 'in a transaction'")
        pause = Background(lambda: admin_post(proxy, "pause", wait=10))
        time.sleep(0.5)
        assert not pause.done, "PAUSE returned while a transaction was open"
        held = Background(lambda: b.execute("select 'b after resume'").fetchone())
        time.sleep(0.3)
        a.commit()  # the running transaction ends: now the pause completes
        result = pause.result(5)
        assert isinstance(result, dict) and result["complete"] is True, result
        assert result["paused"] is True
        wait_for(lambda: live_backends(pg, proxy) == 0, 3, "the servers to be closed")
        time.sleep(0.3)
        assert not held.done, "a query ran while paused"
        resumed = admin_post(proxy, "resume")
        assert resumed["paused"] is False
        assert held.result(5) == ("b after resume",)
        assert a.execute("select 'a fine'").fetchone() == ("a fine",)
        a.commit()
    finally:
        a.close()
        b.close()


def test_a_login_with_a_new_setting_ends_during_pause_and_its_query_waits(scry_proxy, pg) -> None:
    """A setting the pool has never seen is checked on a server before the
    login ends, and PAUSE hands out none. As with PgBouncer, the login ends at
    once and the client's first query waits for RESUME (not for
    client_login_timeout); if PostgreSQL then refuses the setting, that
    query gets its error and the session ends."""
    proxy = make_proxy(scry_proxy, "transaction", client_login_timeout=1)
    with connect(proxy) as first:
        first.execute("select 1")  # (the pool knows its server's defaults)
    assert admin_post(proxy, "pause", wait=5)["complete"] is True
    ok = connect(proxy, options="-c statement_timeout=4321 -c DateStyle=iso,dmy")
    bad = connect(proxy, options="-c lock_timeout=never")
    large = connect(proxy, options="-c statement_timeout=4321")  # (its reads are paused)
    try:
        held = Background(lambda: ok.execute("show statement_timeout").fetchone())
        refused = Background(lambda: bad.execute("select 1").fetchone())
        text = "x" * 600_000
        sized = Background(lambda: large.execute("select length(%s)", (text,)).fetchone())
        time.sleep(2.5)  # (client_login_timeout is 1 s: it must not end them)
        assert not (held.done or refused.done or sized.done), "a query ran while paused"
        assert admin_post(proxy, "resume")["paused"] is False
        assert held.result(5) == ("4321ms",)
        # (Greeted before PostgreSQL was asked; then told its spelling, as by PostgreSQL.)
        assert ok.info.parameter_status("DateStyle") == "ISO, DMY"
        assert sized.result(5) == (600_000,)
        error = refused.result(5)
        assert isinstance(error, psycopg.errors.InvalidParameterValue), repr(error)
        assert 'invalid value for parameter "lock_timeout"' in str(error)
    finally:
        for conn in (ok, bad, large):
            conn.close()
    assert "client_login_timeout" not in proxy.log_text()
    assert "Traceback" not in proxy.log_text()


def test_pause_with_an_idle_client_holding_its_server(scry_proxy, pg) -> None:
    # Transaction mode keeps an idle client's server with it while nobody
    # waits; PAUSE must take it back rather than wait for the client.
    proxy = make_proxy(scry_proxy, "transaction")
    with connect(proxy) as a:
        a.execute("select 1")
        started = time.monotonic()
        result = admin_post(proxy, "pause", wait=5)
        assert result["complete"] is True, result
        assert time.monotonic() - started < 2
        held = Background(lambda: a.execute("select 'a after resume'").fetchone())
        time.sleep(0.4)
        assert not held.done
        admin_post(proxy, "resume")
        assert held.result(5) == ("a after resume",)


def test_pause_completes_when_a_transaction_ends_with_nobody_waiting(scry_proxy, pg) -> None:
    proxy = make_proxy(scry_proxy, "transaction")
    with connect(proxy, autocommit=False) as a:
        a.execute("select 1")
        pause = Background(lambda: admin_post(proxy, "pause", wait=2))
        time.sleep(0.4)
        a.commit()
        result = pause.result(4)
        assert isinstance(result, dict), result
        assert result["complete"] is True, (
            f"PAUSE did not complete after the only transaction ended: {result}"
        )
        admin_post(proxy, "resume")


def test_pause_in_session_mode_waits_for_the_session(scry_proxy, pg) -> None:
    proxy = make_proxy(scry_proxy, "session")
    a = connect(proxy)
    a.execute("select 1")
    result = admin_post(proxy, "pause", wait=0.5)
    assert result["complete"] is False  # a session client still holds its server
    a.close()
    result = admin_post(proxy, "pause", wait=5)
    assert result["complete"] is True, result
    wait_for(lambda: live_backends(pg, proxy) == 0, 3, "the servers to be closed")

    def new_session() -> object:
        with connect(proxy) as conn:
            return conn.execute("select 'new session'").fetchone()

    held = Background(new_session)
    time.sleep(0.4)
    assert not held.done
    admin_post(proxy, "resume")
    assert held.result(5) == ("new session",)


def admin_get(proxy, path: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{proxy.admin_port}/api/v1/{path}",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_pause_holds_a_database_whose_first_login_comes_after_it(scry_proxy, pg) -> None:
    """PAUSE holds new transactions of every database, also of one that had
    no pool yet when PAUSE came (its first login makes the pool afterwards)."""
    proxy = make_proxy(scry_proxy, "transaction")
    proxy.update_config({"databases": {"later": {"database_url": pg.url()}}})
    proxy.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded" in proxy.log_text(), 5, "config reloaded")
    assert admin_post(proxy, "pause", wait=5)["complete"] is True
    later = psycopg.connect(**{**proxy.conninfo(), "dbname": "later"}, autocommit=True)
    try:
        held = Background(lambda: later.execute("select 'after resume'").fetchone())

        def waiting() -> bool:
            pools = admin_get(proxy, "pools")["pools"]
            return any(p["database"] == "later" and p["waiting"] == 1 for p in pools)

        wait_for(waiting, 5, "the query to wait in the new pool")
        assert not held.done
        assert admin_post(proxy, "resume")["paused"] is False
        assert held.result(5) == ("after resume",)
    finally:
        later.close()


def test_sigusr1_pauses_and_sigusr2_resumes(scry_proxy) -> None:
    """PgBouncer's signals, on scry serve too."""
    proxy = make_proxy(scry_proxy, "transaction")
    with connect(proxy) as conn:
        conn.execute("select 1")
        proxy.send_signal(signal.SIGUSR1)
        wait_for(lambda: admin_get(proxy, "status")["paused"], 5, "SIGUSR1 to pause")
        held = Background(lambda: conn.execute("select 'after resume'").fetchone())

        def waiting() -> bool:
            return any(p["waiting"] == 1 for p in admin_get(proxy, "pools")["pools"])

        wait_for(waiting, 5, "the query to wait")
        proxy.send_signal(signal.SIGUSR2)
        assert held.result(5) == ("after resume",)
        assert admin_get(proxy, "status")["paused"] is False
