"""Observability across workers: worker 0's admin API and /metrics answer for the instance.

Each test runs ``scry serve`` with several workers (SO_REUSEPORT spreads the
connections), drives real clients through it, and checks that the instance's
answers are the sums (or merges) of the workers' own (``?worker=N``), that
actions reach the worker that owns a client, that a stopped or dead worker
costs a bounded wait and is named, and that a health-driven breaker opening
on one worker protects all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from admin.histograms import add_histograms
from admin.histograms import percentiles as histogram_percentiles
from admin.schemas import API_PREFIX
from scry.devcluster import free_port

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

TOKEN = "obs-t0k"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Admin:
    """Worker 0's admin API."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.base, headers=AUTH, timeout=15)

    def response(self, method: str, path: str, **params: Any) -> httpx.Response:
        return self.http.request(method, path, params=params)

    def get(self, path: str, **params: Any) -> Any:
        response = self.response("GET", f"{API_PREFIX}{path}", **params)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, **params: Any) -> Any:
        response = self.response("POST", f"{API_PREFIX}{path}", **params)
        assert response.status_code == 200, response.text
        return response.json()

    def answering(self, path: str, **params: Any) -> Any:
        """The answer to a GET, or None while the API is not up (or says 5xx)."""
        try:
            response = self.response("GET", f"{API_PREFIX}{path}", **params)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def metrics(self, **params: Any) -> dict[str, float]:
        """Every sample of /metrics: ``name{label="v",...}`` -> value."""
        response = self.response("GET", "/metrics", **params)
        assert response.status_code == 200, response.text
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples


def start_fleet(scry_proxy, workers: int, wait_until, **overrides: Any) -> tuple[Any, Admin]:
    """A proxy with ``workers`` workers and worker 0's admin API, every worker answering."""
    admin_port = free_port()
    config = {
        "workers": workers,
        "pool": {"size": 2 * workers},
        "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}", "token": TOKEN},
        **overrides,
    }
    proxy = scry_proxy(config)
    admin = Admin(admin_port)

    def everyone_answers() -> bool:
        status = admin.answering("/status")
        return status is not None and status["fleet"]["missing"] == []

    wait_until(everyone_answers, 20, interval=0.1, what=f"{workers} workers answering")
    return proxy, admin


def run_queries(proxy, connections: int, per_connection: int, sql: str) -> None:
    """``connections`` new connections (spread over the workers), each running ``sql``."""

    async def one(i: int) -> None:
        async with await psycopg.AsyncConnection.connect(
            **proxy.conninfo(), autocommit=True
        ) as conn:
            for j in range(per_connection):
                await conn.execute(sql, (i * per_connection + j,))

    async def run() -> None:
        await asyncio.gather(*(one(i) for i in range(connections)))

    asyncio.run(run())


async def fresh_connections(proxy, n: int) -> list[BaseException | None]:
    """What ``select 1`` on ``n`` concurrent new connections ran into (None: nothing)."""

    async def attempt() -> None:
        async with await psycopg.AsyncConnection.connect(
            **proxy.conninfo(), autocommit=True
        ) as conn:
            await conn.execute("select 1")

    return await asyncio.gather(*(attempt() for _ in range(n)), return_exceptions=True)


def probe_rows(top: dict[str, Any], marker: str) -> list[dict[str, Any]]:
    return [q for q in top["queries"] if marker in q["query"]]


# --- totals ------------------------------------------------------------------------------


def test_instance_totals_are_the_sum_of_the_workers(scry_proxy, wait_until) -> None:
    """200 statements over 40 connections and 4 workers: the ranking, the status,
    the pools and /metrics of the instance count all of them, and each is the
    sum of the workers' own answers."""
    proxy, admin = start_fleet(scry_proxy, 4, wait_until)
    connections, each = 40, 5
    total = connections * each
    run_queries(proxy, connections, each, "select %s::int as fleet_probe")

    def fleet_calls() -> bool:
        rows = probe_rows(admin.get("/queries/top", by="calls"), "fleet_probe")
        return len(rows) == 1 and rows[0]["calls"] == total

    wait_until(fleet_calls, 10, interval=0.1, what=f"{total} calls in the fleet ranking")
    top = admin.get("/queries/top", by="calls")
    assert top["fleet"] == {"scope": "instance", "workers": 4, "answered": [0, 1, 2, 3], "missing": []}  # fmt: skip
    (row,) = probe_rows(top, "fleet_probe")
    assert row["errors"] == 0 and row["rows"] == total

    per_worker = {}
    for k in range(4):
        own = admin.get("/queries/top", by="calls", worker=k)
        assert own["fleet"]["scope"] == "worker" and own["fleet"]["answered"] == [k]
        per_worker[k] = probe_rows(own, "fleet_probe")
    calls = {k: sum(r["calls"] for r in rows) for k, rows in per_worker.items()}
    assert sum(calls.values()) == total
    assert sum(1 for n in calls.values() if n) >= 2, calls  # the kernel spread them
    rows = [r for rs in per_worker.values() for r in rs]
    assert row["min_ms"] == min(r["min_ms"] for r in rows)
    assert row["max_ms"] == max(r["max_ms"] for r in rows)
    assert row["total_ms"] == pytest.approx(sum(r["total_ms"] for r in rows), abs=0.01)
    assert row["min_ms"] * 0.98 <= row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
    assert row["p99_ms"] <= row["max_ms"] * 1.02 + 0.001
    # The instance's histogram is the workers' added up; its percentiles are the row's.
    assert row.get("histogram") is None  # (only when asked for)
    (whole,) = probe_rows(admin.get("/queries/top", by="calls", histogram="true"), "fleet_probe")
    own_histograms = [
        r["histogram"]
        for k in range(4)
        for r in probe_rows(
            admin.get("/queries/top", by="calls", worker=k, histogram="true"), "fleet_probe"
        )
    ]
    assert [tuple(pair) for pair in whole["histogram"]] == add_histograms(own_histograms)
    assert sum(count for _, count in whole["histogram"]) == total
    assert histogram_percentiles(whole["histogram"], (0.5, 0.95, 0.99)) == [
        row["p50_ms"], row["p95_ms"], row["p99_ms"]
    ]  # fmt: skip

    # (The merged status is reused for STATUS_TTL: the fleet wait above may have
    # cached one from before the queries.)
    status = wait_until(
        lambda: (got := admin.get("/status"))["queries"]["queries"] >= total and got,
        5,
        interval=0.1,
        what="a status that counts the queries",
    )
    assert status["pid"] == proxy.pid and status["workers"] == 4
    workers = status["per_worker"]
    assert [w["worker"] for w in workers] == [0, 1, 2, 3]
    assert len({w["pid"] for w in workers} | {proxy.pid}) == 5
    queries = status["queries"]["queries"]
    assert queries >= total
    assert queries == sum(w["queries"]["queries"] for w in workers)
    assert status["queries"]["rows"] == sum(w["queries"]["rows"] for w in workers)
    assert status["clients"] == sum(w["clients"] for w in workers)
    assert status["servers"] == sum(w["servers"] for w in workers)
    assert status["queries"]["fingerprints"] <= max(w["queries"]["fingerprints"] for w in workers) + 4  # fmt: skip
    singles = [admin.get("/status", worker=k) for k in range(4)]
    assert sum(x["queries"]["queries"] for x in singles) == queries
    assert [x["pid"] for x in singles] == [w["pid"] for w in workers]

    (pool,) = admin.get("/pools")["pools"]
    assert pool["workers"] == [0, 1, 2, 3]
    assert pool["size"] == 8  # the fleet budget, as configured
    own_pools = [admin.get("/pools", worker=k)["pools"] for k in range(4)]
    assert pool["servers"] == sum(p[0]["servers"] for p in own_pools)
    assert pool["totals"]["servers_opened"] == sum(p[0]["totals"]["servers_opened"] for p in own_pools)  # fmt: skip

    metrics = admin.metrics()
    db = 'database="app"'
    assert metrics[f"scry_queries_total{{{db}}}"] == queries
    assert metrics["scry_query_duration_seconds_count{}"] == queries
    assert metrics['scry_query_duration_seconds_bucket{le="+Inf"}'] == queries
    assert metrics[f'scry_pool_size{{{db},user="app"}}'] == 8
    assert all(metrics[f'scry_worker_up{{worker="{k}"}}'] == 1 for k in range(4))
    own_metrics = [admin.metrics(worker=k) for k in range(4)]
    assert sum(m[f"scry_queries_total{{{db}}}"] for m in own_metrics) == queries
    assert sum(m["scry_query_duration_seconds_sum{}"] for m in own_metrics) == pytest.approx(
        metrics["scry_query_duration_seconds_sum{}"]
    )
    assert all('scry_worker_up{worker="0"}' not in m for m in own_metrics)


# --- listings and actions ------------------------------------------------------------------


def test_clients_are_listed_and_killed_across_workers(scry_proxy, wait_until) -> None:
    proxy, admin = start_fleet(scry_proxy, 4, wait_until)
    conns = [
        psycopg.connect(**proxy.conninfo(), autocommit=True, application_name=f"obs-{i}")
        for i in range(16)
    ]
    try:
        listing = admin.get("/clients", limit=1000)
        ids = [c["id"] for c in listing["clients"]]
        assert len(ids) == len(set(ids)) == listing["total"]
        mine = {c["application_name"]: c for c in listing["clients"]}
        assert sorted(mine) == sorted(f"obs-{i}" for i in range(16))
        for client in mine.values():
            match = re.fullmatch(r"w(\d)\.c\d+", client["id"])
            assert match is not None and int(match[1]) == client["worker"], client
        assert len({c["worker"] for c in mine.values()}) >= 2
        totals = [admin.get("/clients", worker=k)["total"] for k in range(4)]
        assert sum(totals) == listing["total"]
        page = admin.get("/clients", limit=5, offset=5)
        assert [c["id"] for c in page["clients"]] == ids[5:10]
        assert page["total"] == listing["total"]
        servers = admin.get("/servers", limit=1000)["servers"]
        assert {s["worker"] for s in servers} <= {0, 1, 2, 3}
        assert all(s["id"].startswith(f"w{s['worker']}.s") for s in servers)

        name, victim = next((n, c) for n, c in sorted(mine.items()) if c["worker"] != 0)
        result = admin.post(f"/clients/{victim['id']}/kill")
        assert result == {"client_id": victim["id"], "killed": True, "worker": victim["worker"]}
        index = int(name.split("-")[1])
        with pytest.raises(psycopg.OperationalError, match="terminated by administrator"):
            conns[index].execute("select 1")
        for i, conn in enumerate(conns):
            if i != index:
                assert conn.execute("select 1").fetchone() == (1,)
        left = {c["application_name"] for c in admin.get("/clients", limit=1000)["clients"]}
        assert name not in left and len(left) == 15

        plain = admin.response("POST", f"{API_PREFIX}/clients/c1/kill")
        assert plain.status_code == 400 and plain.json()["code"] == "bad_parameter"
        unknown = admin.response("POST", f"{API_PREFIX}/clients/w1.c999999/kill")
        assert unknown.status_code == 404
        # A plain id with ?worker=N reaches that worker (nothing to unpin in transaction mode).
        other = next(c for c in mine.values() if c["worker"] != victim["worker"])
        plain_id = other["id"].split(".")[1]
        unpinned = admin.post(f"/pins/{plain_id}/unpin", worker=other["worker"])
        assert unpinned["client_id"] == other["id"] and not unpinned["unpinned"]
    finally:
        for conn in conns:
            conn.close()


# --- the tail ------------------------------------------------------------------------------


def test_tail_interleaves_every_workers_events(scry_proxy, wait_until) -> None:
    proxy, admin = start_fleet(scry_proxy, 4, wait_until)
    events: list[dict[str, Any]] = []
    subscribed = threading.Event()
    done = threading.Event()

    def read() -> None:
        with httpx.stream(
            "GET", f"{admin.base}{API_PREFIX}/tail", headers=AUTH, timeout=30
        ) as response:
            for line in response.iter_lines():
                item = json.loads(line)
                if item["type"] == "heartbeat" and item.get("missing") == []:
                    subscribed.set()  # every worker's stream is up
                elif item["type"] == "query" and "tail_probe" in item["query"]:
                    events.append(item)
                if done.is_set():
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert subscribed.wait(15), "the tail never had every worker subscribed"
    run_queries(proxy, 40, 2, "select %s::int as tail_probe")
    wait_until(lambda: len(events) >= 80, 10, interval=0.05, what="80 events in the tail")
    done.set()
    reader.join(5)
    assert len(events) == 80
    assert len({e["worker"] for e in events}) >= 2
    for e in events:
        assert e["client_id"].startswith(f"w{e['worker']}.c"), e
    per_client: dict[str, int] = {}
    for e in events:
        per_client[e["client_id"]] = per_client.get(e["client_id"], 0) + 1
    assert sorted(per_client.values()) == [2] * 40  # 40 distinct clients, none confused


# --- a slow or dead worker ------------------------------------------------------------------


def test_a_stopped_or_dead_worker_does_not_hang_the_api(scry_proxy, wait_until) -> None:
    """SIGSTOP one of 3 workers: every endpoint answers within the per-worker
    timeout and names it; an action for it fails and is not carried out late.
    Then SIGKILL it: the replacement answers again."""
    proxy, admin = start_fleet(scry_proxy, 3, wait_until)
    victim = admin.get("/status")["per_worker"][2]["pid"]
    conns = [psycopg.connect(**proxy.conninfo(), autocommit=True) for _ in range(12)]
    listed = admin.get("/clients")["clients"]
    assert len(listed) == 12
    on_victim = [i for i, c in enumerate(listed) if c["worker"] == 2]
    os.kill(victim, signal.SIGSTOP)
    try:
        slowest = 0.0

        def missing(path: str) -> Any:
            nonlocal slowest
            started = time.monotonic()
            answer = admin.get(path)
            slowest = max(slowest, time.monotonic() - started)
            return answer["fleet"]["missing"]

        wait_until(lambda: missing("/status"), 5, what="worker 2 missing from status")
        for path in ("/status", "/pools", "/queries/top", "/hot", "/breaker", "/pins", "/clients"):
            assert missing(path) == [{"worker": 2, "error": "timeout (1 s)"}], path
        assert slowest < 2.5, slowest
        metrics = admin.metrics()
        assert metrics['scry_worker_up{worker="2"}'] == 0
        assert metrics['scry_worker_up{worker="1"}'] == 1
        alone = admin.response("GET", f"{API_PREFIX}/status", worker=2)
        assert alone.status_code == 503 and alone.json()["code"] == "workers_unavailable"
        for i in on_victim:
            kill = admin.response("POST", f"{API_PREFIX}/clients/{listed[i]['id']}/kill")
            assert kill.status_code == 503, kill.text
    finally:
        os.kill(victim, signal.SIGCONT)
    wait_until(lambda: not missing("/pools"), 5, what="worker 2 answering again")
    # The kills it read after waking up were past their deadline: nobody was killed.
    assert "arrived too late; dropped" in proxy.log_text() or not on_victim
    for conn in conns:
        assert conn.execute("select 1").fetchone() == (1,)
        conn.close()

    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        answer = admin.answering("/status", worker=2)
        return answer is not None and answer["pid"] != victim

    wait_until(replaced, 20, interval=0.2, what="a replacement worker 2 answering")
    assert not missing("/pools")


# --- health and breakers ----------------------------------------------------------------------

SICK = "do $$ begin raise exception 'sick' using errcode = 'XX000'; end $$"


def app_breaker(admin: Admin) -> dict[str, Any]:
    """The fleet breaker view of database app."""
    (entry,) = [d for d in admin.get("/breaker")["databases"] if d["database"] == "app"]
    return entry


def wait_all_open_predictively(admin: Admin, wait_until) -> dict[str, Any]:
    """Every worker's breaker of app open, each by a health prediction (its
    own, or one another worker told it); the fleet view of app."""

    def everyone_open() -> dict[str, Any] | None:
        entry = app_breaker(admin)
        states = [w["breaker"]["state"] for w in entry["workers"]]
        return entry if states == ["open"] * len(states) else None

    entry = wait_until(everyone_open, 5, interval=0.1, what="every worker's breaker open")
    reasons = [w["breaker"]["open_reason"] for w in entry["workers"]]
    assert all(re.match(r"(worker \d: )?predictive: ", reason) for reason in reasons), reasons
    assert any(reason.startswith("predictive: ") for reason in reasons), reasons
    return entry


def test_health_driven_opening_on_one_worker_protects_all(scry_proxy, wait_until) -> None:
    """Healthy traffic, then server-sickness errors on one worker's connection:
    the workers share their health windows, so a monitor sees the errors and
    opens its breaker (predictive), every worker's breaker opens (by its own
    judgement or told by another), the fleet breaker view shows the anomaly,
    and new clients on any worker fail fast."""
    proxy, admin = start_fleet(
        scry_proxy,
        3,
        wait_until,
        health={"predictive": True, "window_seconds": 2, "sustain_seconds": 1, "min_samples": 20},
        circuit_breaker={"failure_threshold": 1_000_000, "timeout_seconds": 120},
    )
    conn = psycopg.connect(**proxy.conninfo(), autocommit=True, application_name="sick-maker")
    try:
        (me,) = [
            c for c in admin.get("/clients")["clients"] if c["application_name"] == "sick-maker"
        ]
        sick_worker = me["worker"]

        def app_entry() -> dict[str, Any]:
            return app_breaker(admin)

        def healthy_baseline() -> bool:
            for _ in range(50):  # normal traffic first: the monitor learns "no errors"
                conn.execute("select 1")
            (own,) = [w for w in app_entry()["workers"] if w["worker"] == sick_worker]
            return bool(own["health"]["baseline"]["ready"])

        wait_until(healthy_baseline, 20, interval=0, what="a baseline of healthy traffic")
        deadline = time.monotonic() + 20
        while (entry := app_entry())["breaker"]["state"] == "closed":
            assert time.monotonic() < deadline, (
                f"the breaker never opened: {entry}\n{proxy.log_tail()}"
            )
            for _ in range(50):
                with pytest.raises(psycopg.Error):
                    conn.execute(SICK)

        entry = wait_all_open_predictively(admin, wait_until)
        assert entry["breaker"]["state"] == "open"
        signals = entry["health"]["signals"]
        assert any(s["name"] == "error_rate" for s in signals), signals
        transitions = entry["breaker"]["transitions"]
        assert {t["worker"] for t in transitions if t["to"] == "open"} == {0, 1, 2}

        # Fresh connections (the kernel spreads them over the workers) fail fast.
        failures = asyncio.run(fresh_connections(proxy, 20))
        assert {getattr(f, "sqlstate", f) for f in failures} == {"57P03"}
    finally:
        conn.close()
    admin.post("/breaker/reset", database="app")
    wait_until(
        lambda: {w["breaker"]["state"] for w in app_entry()["workers"]} == {"closed"},
        5,
        what="every worker closed again",
    )


def test_a_database_sick_only_in_aggregate_opens_every_breaker(scry_proxy, wait_until) -> None:
    """Each of 3 workers sees at most ~30 queries a window, below min_samples
    (40); together they see ~90. Sharing their windows, the monitors learn a
    baseline and then open the breakers on the errors (without sharing, no
    monitor would ever judge)."""
    proxy, admin = start_fleet(
        scry_proxy,
        3,
        wait_until,
        health={"predictive": True, "window_seconds": 2, "sustain_seconds": 1, "min_samples": 40},
        circuit_breaker={"failure_threshold": 1_000_000, "timeout_seconds": 120},
    )
    by_worker: dict[int, psycopg.Connection[Any]] = {}
    extra: list[psycopg.Connection[Any]] = []
    try:
        for i in range(60):  # until the kernel has put one on each worker
            conn = psycopg.connect(**proxy.conninfo(), autocommit=True, application_name=f"w-{i}")
            (me,) = [
                c for c in admin.get("/clients")["clients"] if c["application_name"] == f"w-{i}"
            ]
            if me["worker"] in by_worker:
                extra.append(conn)
            else:
                by_worker[me["worker"]] = conn
            if len(by_worker) == 3:
                break
        assert len(by_worker) == 3
        conns = list(by_worker.values())

        def paced(sql: str) -> None:  # ~15 a second per worker
            for conn in conns:
                try:
                    conn.execute(sql)
                except psycopg.Error:
                    pass
            time.sleep(0.06)

        def app_entry() -> dict[str, Any]:
            return app_breaker(admin)

        deadline = time.monotonic() + 20
        while not all(w["health"]["baseline"]["ready"] for w in app_entry()["workers"]):
            assert time.monotonic() < deadline, f"no baseline: {app_entry()['workers']}"
            for _ in range(5):
                paced("select 1")
        while app_entry()["breaker"]["state"] == "closed":
            assert time.monotonic() < deadline + 20, f"never opened: {app_entry()}"
            for _ in range(5):
                paced(SICK)

        wait_all_open_predictively(admin, wait_until)
    finally:
        for conn in [*by_worker.values(), *extra]:
            conn.close()


# --- one worker ----------------------------------------------------------------------------


def test_one_worker_answers_as_a_single_process(scry_proxy, wait_until) -> None:
    """workers: 1 (the default): no fleet fields, plain ids, ?worker=0 only."""
    admin_port = free_port()
    proxy = scry_proxy(
        {"admin": {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}", "token": TOKEN}}
    )
    admin = Admin(admin_port)
    wait_until(lambda: admin.answering("/status"), 10, what="the admin API")
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        conn.execute("select 1")
        status = admin.get("/status")
        assert "fleet" not in status and "per_worker" not in status
        assert status["workers"] == 1
        (client,) = admin.get("/clients")["clients"]
        assert "worker" not in client and re.fullmatch(r"c\d+", client["id"])
        assert (
            "fleet" not in admin.get("/pools") and "workers" not in admin.get("/pools")["pools"][0]
        )
        assert admin.get("/status", worker=0)["pid"] == status["pid"]
        assert admin.response("GET", f"{API_PREFIX}/status", worker=1).status_code == 400
        assert "scry_worker_up" not in admin.response("GET", "/metrics").text
