"""A fake admin API for tests and reproducible screenshots (httpx ``MockTransport``).

``FakeAdmin`` answers every ``/api/v1`` read with fixed, realistic data that
changes a little with each poll (``frame``), so sparklines and ↑/↓ deltas
have something to show, and records the actions it was asked to do. Set
``down = True`` to make it refuse connections (a proxy going away).
:class:`FrozenClock` stops time for the console, so screenshots are stable.

    fakes = {"eu-1": FakeAdmin("eu-1"), "us-1": FakeAdmin("us-1", seed=1)}
    app = ScryConsole(targets, clock=FrozenClock(), tz=UTC,
                      transport_factory=lambda t: fakes[t.name].transport())
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

NOW = 1_714_570_000.0  # 2024-05-01 13:26:40 UTC

QUERIES = [
    (
        "a1f3c9e2b4d60718",
        "SELECT p.id, p.name, p.price FROM products AS p WHERE p.category = $1 ORDER BY p.price LIMIT $2",
        4.1,
        18_230,
        20,
        0,
    ),  # fmt: skip
    (
        "b27e0d41c9a35f62",
        "SELECT * FROM orders WHERE customer_id = $1 ORDER BY created_at DESC LIMIT $2",
        2.4,
        21_004,
        10,
        0,
    ),  # fmt: skip
    (
        "c9d8e7f6a5b4c3d2",
        "SELECT id, name FROM products WHERE to_tsvector($1, description) @@ plainto_tsquery($2)",
        38.5,
        1_510,
        12,
        0,
    ),  # fmt: skip
    (
        "d4c3b2a1f0e9d8c7",
        "UPDATE products SET stock = stock - $1 WHERE id = $2 AND stock >= $1",
        1.2,
        6_120,
        1,
        14,
    ),  # fmt: skip
    (
        "e5f6a7b8c9d0e1f2",
        "INSERT INTO orders (customer_id, total, status) VALUES ($1, $2, $3) RETURNING id",
        1.6,
        6_118,
        1,
        0,
    ),  # fmt: skip
    ("f0e1d2c3b4a59687", "SELECT pg_sleep($1)", 250.0, 61, 1, 0),
    ("0a1b2c3d4e5f6a7b", "SELECT * FROM customers WHERE email = $1", 0.6, 9_880, 1, 0),
    (
        "1b2c3d4e5f6a7b8c",
        "SELECT count(*) FROM order_items oi JOIN orders o ON o.id = oi.order_id WHERE o.created_at > $1",
        96.0,
        240,
        1,
        0,
    ),  # fmt: skip
    ("2c3d4e5f6a7b8c9d", "SELECT * FROM no_such_table WHERE id = $1", 0.3, 300, 0, 300),
    ("3d4e5f6a7b8c9d0e", "BEGIN", 0.05, 6_130, 0, 0),
]

QPS = [812.0, 845.5, 903.2, 1120.8, 1010.4, 968.0, 1205.3, 1180.1]
P99 = [41.0, 44.5, 39.8, 61.2, 88.0, 72.5, 55.1, 49.9]


class FakeAdmin:
    """One fake proxy. ``frame`` advances with each ``/status`` poll."""

    def __init__(self, name: str = "proxy", seed: int = 0, *, pool_mode: str = "hybrid") -> None:
        self.name = name
        self.seed = seed
        self.pool_mode = pool_mode
        self.frame = -1
        self.down = False
        self.actions: list[tuple[str, dict[str, str]]] = []
        self.breaker_state = "closed"
        self.tail_events = self.make_events()
        self.requests = 0
        self.top_params: list[dict[str, str]] = []  # each /queries/top request's query

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    # --- routing --------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.down:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        path = request.url.path.removeprefix("/api/v1")
        params = dict(request.url.params)
        if request.method == "POST":
            return self.post(path, params)
        if path == "/queries/top":
            self.top_params.append(params)
        if path == "/tail":
            return httpx.Response(
                200,
                headers={"Content-Type": "application/x-ndjson"},
                stream=_Stream(self.tail_lines(params)),
            )
        body = {
            "/status": self.status,
            "/pools": self.pools,
            "/clients": self.clients,
            "/servers": self.servers,
            "/pins": self.pins,
            "/breaker": self.breaker,
            "/queries/top": lambda: self.top(
                params.get("by", "total_time"), int(params.get("limit", 50))
            ),
            "/hot": self.hot,
        }.get(path)
        if body is None:
            return httpx.Response(404, json={"code": "not_found", "message": f"no {path}"})
        return httpx.Response(200, json=body())

    def post(self, path: str, params: dict[str, str]) -> httpx.Response:
        self.actions.append((path, params))
        if path.startswith("/pins/"):
            client_id = path.split("/")[2]
            pin = next((p for p in self.pins()["pins"] if p["client_id"] == client_id), None)
            if pin is None:
                return httpx.Response(404, json={"code": "not_found", "message": "no such client"})
            ok = pin["replayable"]
            return httpx.Response(200, json={
                "client_id": client_id, "unpinned": ok,
                "replayed": pin["statements"] if ok else [],
                "lost": [] if ok else [r for r in pin["reasons"] if r not in ("set", "prepare")],
                "disconnected": False, "reason": None if ok else "state cannot be replayed",
            })  # fmt: skip
        if path in ("/breaker/trip", "/breaker/reset"):
            action = path.rsplit("/", 1)[1]
            new = "open" if action == "trip" else "closed"
            changed = [] if new == self.breaker_state else ["app"]
            self.breaker_state = new
            return httpx.Response(
                200, json={"action": action, "changed": changed, **self.breaker()}
            )
        if path.startswith("/clients/") and path.endswith("/kill"):
            return httpx.Response(200, json={"client_id": path.split("/")[2], "killed": True})
        return httpx.Response(404, json={"code": "not_found", "message": path})

    # --- payloads -------------------------------------------------------------------

    def now(self) -> float:
        return NOW + max(0, self.frame) * 2.0

    def status(self) -> dict[str, Any]:
        self.frame += 1
        f = self.frame + self.seed * 3
        qps = QPS[f % len(QPS)] * (0.6 if self.seed else 1.0)
        return {
            "version": "0.1.0", "pid": 4242 + self.seed, "started_at": NOW - 7380,
            "uptime_s": 7380.0 + self.frame * 2, "pool_mode": self.pool_mode,
            "workers": 4 if self.seed else 1, "worker": 0,
            "listen_addr": "0.0.0.0:6432", "listen_addresses": ["0.0.0.0:6432"],
            "admin_addr": "127.0.0.1:6480", "databases": ["app", "reporting"],
            "draining": False, "paused": False, "read_only": False,
            "clients": 184 - 40 * self.seed, "servers": 18 - 4 * self.seed, "pools": 2,
            "waiting": 3 if not self.seed else 0, "pinned": 2,
            "queries": {
                "queries": 1_204_331 + 1000 * self.frame, "errors": 2_115, "rows": 9_812_004,
                "total_ms": 3_912_004.0, "p50_ms": 1.4, "p99_ms": 61.0,
                "window_seconds": 60.0, "window_queries": int(qps * 60), "window_errors": 19,
                "qps": qps, "window_p99_ms": P99[f % len(P99)], "fingerprints": 212,
            },
        }  # fmt: skip

    def pools(self) -> dict[str, Any]:
        busy = 7 if not self.seed else 4
        return {"pools": [
            _pool("app", "app", self.pool_mode, 10, busy, waiting=3 - 3 * self.seed, pinned=2, breaker=self.breaker_state),  # fmt: skip
            _pool("reporting", "analyst", "session", 4, 1, waiting=0, pinned=0, breaker="closed"),
        ]}  # fmt: skip

    def clients(self) -> dict[str, Any]:
        rows = []
        for i in range(6):
            state = ["active", "idle", "waiting", "active", "idle_in_transaction", "idle"][i]
            fp, text = (QUERIES[i][0], QUERIES[i][1]) if state == "active" else (None, None)
            rows.append(
                {
                    "id": f"c{101 + i}",
                    "addr": f"10.0.3.{20 + i}:5{1200 + i}",
                    "user": "app",
                    "database": "app",
                    "application_name": ["checkout", "web", "web", "worker", "admin", "web"][
                        i
                    ],  # fmt: skip
                    "state": state,
                    "connected_at": NOW - 600 - i * 50,
                    "server_id": f"s{10 + i}"
                    if state in ("active", "idle_in_transaction")
                    else None,  # fmt: skip
                    "backend_pid": 3100 + i if state == "active" else None,
                    "parked": False,
                    "waiting": state == "waiting",
                    "wait_ms": 212.0 if state == "waiting" else None,
                    "idle_s": 1.5 * i,
                    "pinned": i == 4,
                    "pin_reasons": ["temp_table"] if i == 4 else [],
                    "fingerprint": fp,
                    "query": text,
                    "running_ms": 12.5 * (i + 1) if state == "active" else None,  # fmt: skip
                }
            )
        return {"total": len(rows), "offset": 0, "limit": 500, "clients": rows}

    def servers(self) -> dict[str, Any]:
        rows = [
            {"id": f"s{10 + i}", "database": "app", "user": "app",
             "state": ["active", "idle", "active", "idle", "active"][i],
             "client_id": f"c{101 + i}" if i % 2 == 0 else None, "backend_pid": 3100 + i,
             "local_addr": f"127.0.0.1:4{1000 + i}", "created_at": NOW - 3600, "age_s": 3600.0 - 60 * i,
             "idle_s": None if i % 2 == 0 else 4.0 * i, "pending": 0,
             "tx_status": "T" if i == 4 else "I", "pinned": i == 4, "retire": False}
            for i in range(5)
        ]  # fmt: skip
        return {"total": len(rows), "offset": 0, "limit": 500, "servers": rows}

    def pins(self) -> dict[str, Any]:
        return {"pins": [
            {"client_id": "c105", "server_id": "s14", "backend_pid": 3104, "database": "app",
             "user": "app", "application_name": "admin", "reasons": ["temp_table", "set"],
             "replayable": False, "since": NOW - 754, "pinned_s": 754.0, "holding_server": True,
             "replay_pending": False, "counts": {"temp_table": 1, "set": 2},
             "settings": ["search_path", "work_mem"], "statements": ["SET work_mem = $1"],
             "pinned_by": {"temp_table": "CREATE TEMP TABLE report_tmp AS SELECT * FROM orders WHERE created_at > $1",
                           "set": "SET work_mem = $1"}},
            {"client_id": "c117", "server_id": "s12", "backend_pid": 3102, "database": "app",
             "user": "app", "application_name": "checkout", "reasons": ["prepare", "set"],
             "replayable": True, "since": NOW - 95, "pinned_s": 95.0, "holding_server": True,
             "replay_pending": False, "counts": {"prepare": 3, "set": 1},
             "settings": ["statement_timeout"],
             "statements": ["SET statement_timeout = $1", "PREPARE s1 AS SELECT * FROM products WHERE id = $1"],
             "pinned_by": {"prepare": "PREPARE s1 AS SELECT * FROM products WHERE id = $1",
                           "set": "SET statement_timeout = $1"}},
        ]}  # fmt: skip

    def breaker(self) -> dict[str, Any]:
        return {"databases": [
            _breaker_entry("app", self.breaker_state, failures=14, saturation=0.9, signals=[
                {"name": "pool_saturation", "severity": "warning", "value": 0.9, "threshold": 0.85,
                 "for_seconds": 42.0, "message": "pool 90% busy (threshold 85%)"},
                {"name": "p99_regression", "severity": "critical", "value": 88.0, "threshold": 60.0,
                 "for_seconds": 18.0, "message": "p99 88 ms vs baseline 22 ms"},
            ] if not self.seed else []),
            _breaker_entry("reporting", "closed", failures=0, saturation=0.25, signals=[]),
        ]}  # fmt: skip

    def top(self, by: str, limit: int = 50) -> dict[str, Any]:
        scale = 1.0 + 0.15 * max(0, self.frame) + 0.5 * self.seed
        rows = []
        for i, (fp, text, mean, calls, rows_per, errors) in enumerate(QUERIES):
            if self.seed and i == 5:
                continue
            c = int(calls * scale)
            # The text search gets slower each frame: an ↑ to look at.
            # and the order_items count climbs the ranking.
            m = mean * (1 + 0.35 * max(0, self.frame)) if i == 2 else mean
            if i == 7:
                m = mean * (1 + 1.2 * max(0, self.frame))
            rows.append({"fingerprint": fp, "query": text, "calls": c, "errors": int(errors * scale),
                         "rows": c * rows_per, "total_ms": c * m, "mean_ms": m, "min_ms": m * 0.2,
                         "max_ms": m * 9, "p50_ms": m * 0.8, "p95_ms": m * 2.6, "p99_ms": m * 4.1,
                         "share": 0.0, "queue_ms_mean": m * 0.05, "backend_ms_mean": m * 0.85,
                         "total_ms_mean": m, "first_seen": NOW - 7000, "last_seen": self.now()})  # fmt: skip
        total = sum(r["total_ms"] for r in rows)
        for r in rows:
            r["share"] = r["total_ms"] / total
        key = {"total_time": "total_ms", "mean": "mean_ms", "calls": "calls", "errors": "errors", "p99": "p99_ms"}[by]  # fmt: skip
        rows.sort(key=lambda r: -r[key])
        return {"by": by, "window_seconds": None, "limit": limit, "queries": rows[:limit]}

    def hot(self) -> dict[str, Any]:
        return {
            "tables": [{"table": t, "count": n * (1 + self.seed)} for t, n in
                       (("products", 48_210.0), ("orders", 31_877.0), ("customers", 9_880.0),
                        ("order_items", 2_400.0), ("no_such_table", 300.0))],
            "values": [{"column": c, "value": v, "count": n} for c, v, n in
                       (("products.id", "9f2c1e77a0b3d4e5", 4_210.0), ("customers.email", "1c0ffee5badf00d1", 1_877.0),
                        ("products.category", "77aa00bb11cc22dd", 1_120.0), ("orders.customer_id", "0ddba11c0ffee000", 640.0))],
        }  # fmt: skip

    # --- the tail ---------------------------------------------------------------------

    def make_events(self) -> list[dict[str, Any]]:
        events = []
        for i in range(24):
            fp, text, mean, _, rows_per, errors = QUERIES[(i * 7 + self.seed) % len(QUERIES)]
            failed = errors > 0 and i % 3 == 0
            total_us = int(mean * 1000 * (0.6 + (i % 5) * 0.2))
            events.append(
                {
                    "type": "query",
                    "ts": NOW - 30 + i * 1.25,
                    "worker": 0,
                    "client_id": f"c{101 + i % 6}",
                    "database": "app",
                    "user": "app",
                    "application_name": "web",
                    "fingerprint": fp,
                    "query": text,
                    "queue_us": total_us // 20,
                    "pool_acquire_us": total_us // 10,
                    "backend_us": total_us - total_us // 20 - total_us // 10,
                    "total_us": total_us,
                    "rows": 0 if failed else rows_per,
                    "sqlstate": ("42P01" if fp.startswith("2c") else "40001")
                    if failed
                    else None,  # fmt: skip
                    "pinned": i % 11 == 0,
                    "pin_reasons": ["prepare"] if i % 11 == 0 else [],
                }
            )
        return events

    def tail_lines(self, params: dict[str, str]) -> list[bytes]:
        fp = params.get("fingerprint")
        lines = []
        for event in self.tail_events:
            if fp and event["fingerprint"] != fp:
                continue
            if params.get("errors") == "true" and not event["sqlstate"]:
                continue
            lines.append((json.dumps(event) + "\n").encode())
        return lines


class _Stream(httpx.AsyncByteStream):
    """The lines, then silence like a quiet proxy (the console cancels it on exit).

    An iterator object rather than an async generator: a generator cancelled
    mid-await would be finalized later from another task, noisily.
    """

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = list(lines)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> bytes:
        if self.lines:
            return self.lines.pop(0)
        await asyncio.Event().wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.lines = []


def _pool(db: str, user: str, mode: str, size: int, active: int, *, waiting: int, pinned: int, breaker: str) -> dict[str, Any]:  # fmt: skip
    return {
        "database": db, "user": user, "mode": mode, "size": size, "min_size": 0,
        "servers": active + pinned + 1, "connecting": 0, "active": active, "idle": 1, "parked": 0,
        "waiting": waiting, "max_wait_ms": 212.0 if waiting else 0.0, "pinned": pinned,
        "stale": False, "breaker": breaker, "last_error": None,
        "totals": {"waits": 120, "wait_ms_total": 5400.0, "wait_ms_mean": 45.0,
                   "servers_opened": 31, "servers_closed": 20},
    }  # fmt: skip


def _breaker_entry(db: str, state: str, *, failures: int, saturation: float, signals: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    transitions = [
        {"at": NOW - 3000, "seconds_ago": 3000.0, "from": "closed", "to": "open", "reason": "5 consecutive failures: connection refused"},  # fmt: skip
        {"at": NOW - 2970, "seconds_ago": 2970.0, "from": "open", "to": "half_open", "reason": "timeout elapsed"},  # fmt: skip
        {"at": NOW - 2968, "seconds_ago": 2968.0, "from": "half_open", "to": "closed", "reason": "3 probes succeeded"},  # fmt: skip
    ] if failures else []  # fmt: skip
    return {
        "database": db,
        "breaker": {
            "name": db, "state": state, "enabled": True, "held": state == "open",
            "open_reason": "tripped from the scry console" if state == "open" else None,
            "retry_in_seconds": None,
            "config": {"failure_threshold": 5, "success_threshold": 3, "timeout_seconds": 30.0, "half_open_max_probes": 1},  # fmt: skip
            "counters": {"failures": failures, "successes": 120_000, "rejections": 37 if failures else 0,
                         "consecutive_failures": 0, "opened": 1 if failures else 0},  # fmt: skip
            "last_failure_reason": "connection refused" if failures else None,
            "half_open": {"probes_in_flight": 0, "probe_successes": 0},
            "transitions": transitions,
        },
        "health": {
            "name": db, "window_seconds": 60,
            "window": {"queries": 54_000, "errors": 19 if failures else 0, "qps": 900.0 if failures else 12.0,
                       "error_rate": 0.00035 if failures else 0.0, "p50": 1.4, "p99": 88.0 if failures else 9.0,
                       "wait_mean": 4.0, "wait_max": 212.0},
            "pool": {"saturation": saturation, "waiting": 3 if failures else 0, "oldest_wait_seconds": 0.2},
            "baseline": {"p50": 1.2, "p99": 22.0 if failures else 8.5, "error_rate": 0.0002, "ready": True},
            "signals": signals,
        },
    }  # fmt: skip


class FrozenClock:
    """Time stands still unless a test moves it (``advance``)."""

    def __init__(self, wall: float = NOW, mono: float = 1000.0) -> None:
        self.wall = wall
        self.mono = mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def fake_console(
    names: tuple[str, ...] = ("eu-west-1", "us-east-1"), **kwargs: Any
) -> tuple[Any, dict[str, FakeAdmin], FrozenClock]:
    """A console over :class:`FakeAdmin` proxies with a frozen clock, in UTC.

    Returns ``(app, fakes by name, clock)``; polls only when told
    (``refresh`` is an hour), so a test decides when data changes.
    """
    import datetime as dt

    from scry_tui.app import ScryConsole
    from scry_tui.targets import make_target

    fakes = {name: FakeAdmin(name, seed=i) for i, name in enumerate(names)}
    targets = [make_target(f"http://10.0.{i}.5:6480", name=n) for i, n in enumerate(names)]
    clock = FrozenClock()
    kwargs.setdefault("refresh", 3600)
    app = ScryConsole(
        targets,
        clock=clock,
        tz=dt.UTC,
        transport_factory=lambda t: fakes[t.name].transport(),
        **kwargs,
    )
    return app, fakes, clock


async def refreshed(
    pilot: Any, app: Any, rounds: int = 1, clock: FrozenClock | None = None
) -> None:
    """Poll every proxy ``rounds`` more times (2 s apart on ``clock``) and let the UI settle."""
    from scry_tui.launch import poll_round, wait_first_poll

    await wait_first_poll(app, pilot, 5.0)
    for _ in range(rounds):
        if clock is not None:
            clock.advance(2.0)
        await poll_round(app, pilot, 5.0)
    await pilot.pause()
