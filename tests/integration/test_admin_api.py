"""The admin API of a running ``scry serve`` against a real PostgreSQL.

Each endpoint's payload is checked against state the test created: a
pinned hybrid session shows in /pins with its reason and survives a
force-unpin with its setting; a tripped breaker makes clients fail fast
with SQLSTATE 57P03; a killed client gets 57P01. Plus authorization and a
bounded schemathesis run against the served OpenAPI document.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from rawpg import Raw, fields, kinds, q

from scry.devcluster import free_port

TOKEN = "t0k-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CANARY = "canary-7d1e"


def start_admin_proxy(scry_proxy, admin: dict[str, Any] | None = None, **overrides: Any):
    """A running proxy (hybrid, pool of 3) with its admin API; returns (proxy, base URL)."""
    port = free_port()
    settings: dict[str, Any] = {"enabled": True, "listen_addr": f"127.0.0.1:{port}"}
    settings["token"] = TOKEN
    settings.update(admin or {})
    config = {"pool": {"mode": "hybrid", "size": 3}, "admin": settings, **overrides}
    proxy = scry_proxy(config)
    base = f"http://127.0.0.1:{settings['listen_addr'].rpartition(':')[2]}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proxy, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"admin API not up\n{proxy.log_tail()}")
        time.sleep(0.05)


def get(base: str, path: str, **params: Any) -> Any:
    response = httpx.get(base + path, params=params, headers=AUTH, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def post(base: str, path: str, status: int = 200, **params: Any) -> Any:
    response = httpx.post(base + path, params=params, headers=AUTH, timeout=10)
    assert response.status_code == status, response.text
    return response.json()


def connect(proxy, **kw: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(**proxy.conninfo(), autocommit=True, **kw)


def test_state_endpoints_reflect_real_connections(scry_proxy, wait_until) -> None:
    proxy, base = start_admin_proxy(scry_proxy)
    with connect(proxy, application_name="admin-probe") as conn:
        backend_pid = conn.execute("select pg_backend_pid()").fetchone()[0]
        conn.execute("select 1 from pg_class where relname = %s", (CANARY,))

        status = get(base, "/api/v1/status")
        assert status["pool_mode"] == "hybrid" and status["clients"] == 1
        assert status["listen_addresses"] == [f"127.0.0.1:{proxy.port}"]
        assert status["admin_addr"] == base.removeprefix("http://")

        (pool,) = get(base, "/api/v1/pools")["pools"]
        assert (pool["database"], pool["user"], pool["mode"], pool["size"]) == (
            "app",
            "app",
            "hybrid",
            3,
        )
        assert pool["servers"] == 1 and pool["active"] + pool["idle"] == 1

        clients = get(base, "/api/v1/clients")
        (client,) = clients["clients"]
        assert client["application_name"] == "admin-probe" and client["state"] == "idle"
        assert client["addr"].startswith("127.0.0.1:") and client["pinned"] is False

        (server,) = get(base, "/api/v1/servers")["servers"]
        assert server["backend_pid"] == backend_pid and server["database"] == "app"

        assert get(base, "/api/v1/clients", limit=1, offset=1)["clients"] == []

        def ranked() -> Any:
            rows = get(base, "/api/v1/queries/top", by="calls", limit=50)["queries"]
            return [r for r in rows if "pg_class" in r["query"]]

        (row,) = wait_until(ranked, 5, what="the query in the ranking")
        assert row["calls"] == 1 and CANARY not in row["query"]
        with_histogram = get(base, "/api/v1/queries/top", by="calls", histogram="true")["queries"]
        (same,) = [r for r in with_histogram if "pg_class" in r["query"]]
        ((value_ms, count),) = same["histogram"]
        assert count == 1 and value_ms == row["p99_ms"]
        hot = get(base, "/api/v1/hot", limit=10)
        assert hot == get(base, "/debug/hot_data", limit=10) or hot["tables"]

        metrics = httpx.get(f"{base}/metrics", headers=AUTH).text
        assert 'scry_pool_size{database="app",user="app"} 3.0' in metrics

        # The statement a client runs now, once the observatory knows its text.
        with connect(proxy) as busy:
            busy.execute("select pg_sleep(0.1)")

            def known() -> Any:
                rows = get(base, "/api/v1/queries/top", by="calls", limit=50)["queries"]
                return [r for r in rows if r["query"] == "select pg_sleep($1)"]

            wait_until(known, 5, what="the observatory to know pg_sleep's fingerprint")
            # Long enough that a loaded machine's polling cannot miss it running.
            worker = threading.Thread(
                target=busy.execute, args=("select pg_sleep(3.0)",)
            )  # same digit shape
            worker.start()

            def running() -> Any:
                rows = get(base, "/api/v1/clients")["clients"]
                return [c for c in rows if c["state"] == "active" and c["fingerprint"]]

            (active,) = wait_until(running, 5, what="an active client with a fingerprint")
            worker.join(10)
        assert active["query"] == "select pg_sleep($1)" and active["running_ms"] >= 0

        kill = post(base, f"/api/v1/clients/{client['id']}/kill")
        assert kill == {"client_id": client["id"], "killed": True}
        with pytest.raises(psycopg.OperationalError, match="terminated by administrator"):
            conn.execute("select 1")
    wait_until(lambda: get(base, "/api/v1/status")["clients"] == 0, 5, what="client gone")


def test_pins_force_unpin_keeps_the_session(scry_proxy) -> None:
    proxy, base = start_admin_proxy(scry_proxy)
    with connect(proxy) as conn, connect(proxy) as other:
        conn.execute("SET statement_timeout = '5s'")
        conn.execute(f"SET myapp.token = {CANARY.replace('-', '_')}")  # a value written as a name
        other.execute("CREATE TEMP TABLE scratch (x int)")
        pins = {p["client_id"]: p for p in get(base, "/api/v1/pins")["pins"]}
        assert len(pins) == 2
        by_reason = {tuple(p["reasons"]): p for p in pins.values()}
        set_pin = by_reason[("set",)]
        temp_pin = by_reason[("temp_table",)]
        assert set_pin["replayable"] and not temp_pin["replayable"]
        assert set_pin["holding_server"] and set_pin["server_id"]
        assert sorted(set_pin["settings"]) == ["myapp.token", "statement_timeout"]
        # Statements are anonymized: the literal never leaves the process.
        assert set_pin["statements"] and "'5s'" not in str(set_pin)  # (a token may hold "5s")
        assert CANARY.replace("-", "_") not in str(set_pin)
        assert "SET myapp.token = $1" in set_pin["statements"]
        assert set_pin["since"] <= time.time() and set_pin["pinned_s"] >= 0
        assert get(base, "/api/v1/pools")["pools"][0]["pinned"] == 2
        metrics = httpx.get(f"{base}/metrics", headers=AUTH).text
        assert 'scry_pins_total{reason="set"} 1.0' in metrics
        assert 'scry_pins_total{reason="temp_table"} 1.0' in metrics

        result = post(base, f"/api/v1/pins/{set_pin['client_id']}/unpin")
        assert result["unpinned"] and result["replayed"] == ["set"] and result["lost"] == []
        after = {p["client_id"]: p for p in get(base, "/api/v1/pins")["pins"]}
        moved = after.get(set_pin["client_id"])
        assert moved is None or (not moved["holding_server"] and moved["replay_pending"])
        # The client still works and its setting came along.
        assert conn.execute("show statement_timeout").fetchone()[0] == "5s"

        refused = post(base, f"/api/v1/pins/{temp_pin['client_id']}/unpin")
        assert refused["unpinned"] is False and refused["lost"] == ["temp_table"]
        assert other.execute("select count(*) from scratch").fetchone()[0] == 0
        dropped = post(base, f"/api/v1/pins/{temp_pin['client_id']}/unpin", disconnect="true")
        assert dropped["unpinned"] and dropped["disconnected"]
        with pytest.raises(psycopg.OperationalError):
            other.execute("select 1")


def test_health_anomalies_are_logged_and_counted(scry_proxy, wait_until) -> None:
    """A client starved of a server raises the starvation signal: one log line
    when it appears, one when it clears, and a count in /metrics."""
    proxy, base = start_admin_proxy(
        scry_proxy,
        pool={"mode": "transaction", "size": 1},
        health={"starvation_seconds": 0.3, "window_seconds": 2},
    )
    with connect(proxy) as holder, connect(proxy) as waiter:
        holder.execute("begin")
        holder.execute("select 1")  # holds the only server
        done = threading.Event()
        worker = threading.Thread(target=lambda: (waiter.execute("select 1"), done.set()))
        worker.start()
        try:
            wait_until(lambda: "health anomaly " in proxy.log_text(), timeout=10)
        finally:
            holder.execute("commit")
            worker.join(10)
        assert done.is_set()
        (line,) = [x for x in proxy.log_text().splitlines() if "health anomaly " in x]
        assert "kind=starvation" in line and "database=app" in line
        metrics = httpx.get(f"{base}/metrics", headers=AUTH).text
        assert 'scry_health_anomalies_total{database="app",kind="starvation"} 1.0' in metrics
        wait_until(lambda: "health anomaly cleared" in proxy.log_text(), timeout=10)
        assert proxy.log_text().count("health anomaly") == 2


def test_breaker_trip_fails_fast_and_reset(scry_proxy) -> None:
    proxy, base = start_admin_proxy(scry_proxy)
    with connect(proxy) as conn:
        conn.execute("select 1")
    tripped = post(base, "/api/v1/breaker/trip", database="app", reason="maintenance")
    assert tripped["changed"] == ["app"]
    (entry,) = get(base, "/api/v1/breaker")["databases"]
    breaker = entry["breaker"]
    assert (
        breaker["state"] == "open" and breaker["held"] and breaker["open_reason"] == "maintenance"
    )
    assert breaker["transitions"][0]["to"] == "open"
    assert "signals" in entry["health"] and "baseline" in entry["health"]
    started = time.monotonic()
    with connect(proxy) as conn:
        with pytest.raises(psycopg.errors.CannotConnectNow) as caught:
            conn.execute("select 1")
        assert caught.value.sqlstate == "57P03" and "maintenance" in str(caught.value)
    assert time.monotonic() - started < 2
    reset = post(base, "/api/v1/breaker/reset")
    assert reset["changed"] == ["app"] and reset["databases"][0]["breaker"]["state"] == "closed"
    with connect(proxy) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_a_set_the_breaker_refused_never_pins(scry_proxy) -> None:
    """The client was told its SET failed (57P03): it must not be tracked as
    run, pinning the client and replayed on its next server."""
    proxy, base = start_admin_proxy(scry_proxy)
    with connect(proxy) as conn:
        conn.execute("select 1")
        post(base, "/api/v1/breaker/trip", database="app")
        with pytest.raises(psycopg.errors.CannotConnectNow):
            conn.execute("SET statement_timeout = '1234ms'")
        post(base, "/api/v1/breaker/reset")
        assert conn.execute("select 1").fetchone() == (1,)
        assert get(base, "/api/v1/pins")["pins"] == []
        assert conn.execute("show statement_timeout").fetchone() == ("0",)


def test_the_breaker_answers_a_message_once_it_is_whole(scry_proxy) -> None:
    """A Query, then the head of the next one, while the breaker is open: the
    refusal waits for the rest (the head alone must not be dropped and its
    tail sent on later); a Query larger than a waiting client may queue is
    still read to its end and refused."""
    proxy, base = start_admin_proxy(
        scry_proxy, pool={"mode": "transaction", "size": 2}, auth={"type": "trust"}
    )
    client = Raw(proxy.port)
    try:
        client.send(q("select 1"))
        client.until_ready()
        post(base, "/api/v1/breaker/trip", database="app")
        second = q("select 2 /* " + "x" * 1000 + " */")
        client.send(q("select 1"), second[:100])
        post(base, "/api/v1/breaker/reset")
        client.send(second[100:])
        assert kinds(client.until_ready() + client.until_ready()) == "TDCZTDCZ"
        post(base, "/api/v1/breaker/trip", database="app")
        client.send(q("select 3 /* " + "x" * 2_000_000 + " */"))
        answer = client.until_ready()
        assert kinds(answer) == "EZ" and fields(answer[0][1])["C"] == "57P03"
    finally:
        client.close()


def test_authorization(scry_proxy) -> None:
    _, base = start_admin_proxy(scry_proxy)
    assert httpx.get(f"{base}/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("GET", "/api/v1/status"), ("GET", "/metrics"), ("POST", "/api/v1/breaker/reset")):  # fmt: skip
            response = httpx.request(method, base + path, headers=headers)
            assert response.status_code == 401, (headers, path)
            assert response.json()["code"] == "unauthorized"

    _, read_only = start_admin_proxy(scry_proxy, {"read_only": True, "metrics_public": True})
    assert httpx.get(f"{read_only}/metrics").status_code == 200
    assert get(read_only, "/api/v1/status")["read_only"] is True
    response = httpx.post(f"{read_only}/api/v1/breaker/trip", headers=AUTH)
    assert response.status_code == 403 and response.json()["code"] == "read_only"

    _, open_base = start_admin_proxy(scry_proxy, {"token": None})
    assert httpx.get(f"{open_base}/api/v1/pools").status_code == 200
    response = httpx.post(f"{open_base}/api/v1/breaker/trip")
    assert response.status_code == 403 and response.json()["code"] == "token_required"


def raw_request(base: str, head: bytes) -> bytes:
    """The status line of the answer to a hand-written request (what httpx refuses to send)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_authorization_holds_against_odd_headers_and_reloads(scry_proxy, wait_until) -> None:
    port = free_port()
    proxy, base = start_admin_proxy(scry_proxy, {"listen_addr": f"0.0.0.0:{port}"})
    # Bytes that are not UTF-8 are a wrong token, not a server error.
    assert b" 401 " in raw_request(base, b"Authorization: Bearer \xff\xfe\r\n\r\n")
    # A request aiohttp cannot parse (the token, then a stray CR) is logged
    # in one line, without its headers.
    raw_request(base, b"Authorization: Bearer " + TOKEN.encode() + b"\r\r\n\r\n")
    wait_until(lambda: "a request could not be handled" in proxy.log_tail(20), 5)
    assert TOKEN not in proxy.log_path.read_text()
    # A reload cannot open the API it listens with on 0.0.0.0: without the
    # token in the new file, every request is refused until a restart.
    proxy.write_config({**proxy.config, "admin": {"listen_addr": f"127.0.0.1:{port}"}})
    assert post(base, "/api/v1/reload")["databases"] == ["app"]
    response = httpx.get(f"{base}/api/v1/status")
    assert response.status_code == 403 and response.json()["code"] == "token_required"
    assert f"0.0.0.0:{port}" in response.json()["message"]
    assert httpx.get(f"{base}/healthz").status_code == 200


def test_reload_and_pause(scry_proxy) -> None:
    proxy, base = start_admin_proxy(scry_proxy)
    assert post(base, "/api/v1/reload")["databases"] == ["app"]
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good + "\nno_such_key: 1\n")
    failed = post(base, "/api/v1/reload", status=400)
    assert failed["code"] == "invalid_config" and "no_such_key" in failed["message"]
    # Valid, but it cannot be applied: not reloaded either, and said so.
    proxy.config_path.write_text(good + "\nauth:\n  type: md5\n  auth_file: /nonexistent/u.txt\n")
    failed = post(base, "/api/v1/reload", status=400)
    assert failed["code"] == "invalid_config" and "/nonexistent/u.txt" in failed["message"]
    proxy.config_path.write_text(good)

    with connect(proxy) as conn:
        conn.execute("select 1")
    response = httpx.post(f"{base}/api/v1/pause", params={"wait": 2}, headers=AUTH, timeout=10)
    if response.status_code == 501:
        pytest.skip("this proxy has no PAUSE")
    assert response.status_code == 200, response.text
    assert response.json()["paused"] is True
    assert get(base, "/api/v1/status")["paused"] is True
    assert post(base, "/api/v1/resume")["paused"] is False
    with connect(proxy) as conn:
        assert conn.execute("select 2").fetchone() == (2,)


def test_openapi_schemathesis(scry_proxy) -> None:
    """Bounded property-based run: no 5xx, every answer matches the document."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    proxy, base = start_admin_proxy(scry_proxy)
    with connect(proxy) as conn:  # something to list
        conn.execute("SET search_path = public")
        document = get(base, "/api/v1/openapi.json")
        schema = schemathesis.openapi.from_dict(document)
        checks = [
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
        tested = 0
        deadline = time.monotonic() + 25
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path == "/api/v1/tail":
                continue  # a stream that never ends; covered by test_admin_tail
            if operation.path.endswith(("/kill", "/unpin", "/pause")):
                # kill/unpin would end our own client; pause waits (up to ?wait=)
                # for its pinned session. All three are covered above.
                continue

            @settings(
                max_examples=8,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def run(case: Any) -> None:
                case.call_and_validate(base_url=base, headers=AUTH, checks=checks, timeout=10)

            run()
            tested += 1
            assert time.monotonic() < deadline, "schemathesis run took too long"
        assert tested >= 15
        # Mutating calls above (trip, pause, ...) must leave the proxy serving.
        httpx.post(f"{base}/api/v1/resume", headers=AUTH)
        httpx.post(f"{base}/api/v1/breaker/reset", headers=AUTH)
