"""The console's views computed from stand-in pools, servers and clients (no sockets).

What the integration tests cannot catch in the act: a cancel in flight, a
server held back until PostgreSQL processed a cancel, bytes not yet written.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from scry.pgbouncer.dispatch import AdminConsole
from scry.pool import PoolStats


def decode(answer: bytes) -> tuple[list[str], list[list[str | None]]]:
    """(column names, rows) of a console answer."""
    columns: list[str] = []
    rows: list[list[str | None]] = []
    pos = 0
    while pos < len(answer):
        kind, size = answer[pos : pos + 1], int.from_bytes(answer[pos + 1 : pos + 5], "big")
        body = answer[pos + 5 : pos + 1 + size]
        pos += 1 + size
        if kind == b"T":
            at = 2
            for _ in range(int.from_bytes(body[:2], "big")):
                end = body.index(b"\0", at)
                columns.append(body[at:end].decode())
                at = end + 1 + 18
        elif kind == b"D":
            row: list[str | None] = []
            at = 2
            for _ in range(int.from_bytes(body[:2], "big")):
                length = int.from_bytes(body[at : at + 4], "big", signed=True)
                at += 4
                row.append(None if length < 0 else body[at : at + length].decode())
                at += max(length, 0)
            rows.append(row)
        elif kind == b"E":
            raise AssertionError(body)
    return columns, rows


class FakeTransport:
    def __init__(self, pending: int = 0) -> None:
        self.pending = pending

    def get_write_buffer_size(self) -> int:
        return self.pending

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 40000) if name in ("sockname", "peername") else None


class FakeProxy:
    """Just what the views read (a class: the console keeps weak references)."""

    def __init__(self) -> None:
        self.pools: dict[Any, Any] = {}
        self.clients: set[Any] = set()
        self.targets: dict[str, Any] = {}
        self.clock = 100.0
        self.started_at = 0.0
        timeouts = SimpleNamespace(server_check_delay=30.0, server_lifetime=3600.0)
        self.config = SimpleNamespace(timeouts=timeouts, pgbouncer=None, databases={})
        self.identity = SimpleNamespace(workers=1)


def server(ident: str, pool: Any, **state: Any) -> Any:
    fields = {
        "id": ident, "pool": pool, "state": "idle", "client": None, "release_after_cancel": False,
        "cancels_pending": 0, "last_used": 99.0, "created_at": 1.0, "retire": False,
        "local_addr": "127.0.0.1:5000", "address": ("127.0.0.1", 5432), "backend_pid": 4242,
        "tls": False,
        "statements": SimpleNamespace(names={}), "transport": FakeTransport(),
    }  # fmt: skip
    fields.update(state)
    return SimpleNamespace(**fields)


def make_pool(proxy: FakeProxy) -> Any:
    target = SimpleNamespace(
        name="app", host="127.0.0.1", port=5432, dbname="app", user=None,
        load_balance_hosts="round-robin",
    )  # fmt: skip
    pool = SimpleNamespace(
        target=target, server_user="app", mode="transaction", connecting=1, stale=False,
        stats=PoolStats(), total_wait_us=0, oldest_wait=lambda: 1.5, servers=[],
    )  # fmt: skip
    proxy.pools[("app", "app")] = pool
    proxy.targets["app"] = target
    return pool


def test_pools_count_cancels_and_servers_held_for_them() -> None:
    proxy = FakeProxy()
    pool = make_pool(proxy)
    client = SimpleNamespace(parked=False)
    pool.servers = [
        server("s1", pool, client=client, cancels_pending=2),  # running, being cancelled
        server("s2", pool, release_after_cancel=True, cancels_pending=1),  # released
        server("s3", pool),  # idle
        server("s4", pool, last_used=1.0),  # idle past server_check_delay
    ]
    columns, rows = decode(AdminConsole(proxy, "admin", admin=True).handle_query("SHOW POOLS"))
    app = dict(zip(columns, rows[0], strict=True))
    assert app["cl_active_cancel_req"] == app["sv_active_cancel"] == "3"
    assert app["cl_waiting_cancel_req"] == "0"
    assert app["sv_active"] == "1"
    assert app["sv_being_canceled"] == "1"
    assert app["sv_idle"] == "1"
    assert app["sv_used"] == "1"
    assert app["sv_login"] == "1"
    assert (app["maxwait"], app["maxwait_us"]) == ("1", "500000")


def test_active_sockets_are_those_with_unsent_data() -> None:
    proxy = FakeProxy()
    pool = make_pool(proxy)
    pool.servers = [server("s1", pool), server("s2", pool, transport=FakeTransport(8192))]
    console = AdminConsole(proxy, "admin", admin=True)
    columns, rows = decode(console.handle_query("SHOW ACTIVE_SOCKETS"))
    assert [(r[columns.index("ptr")], r[columns.index("send_avail")]) for r in rows] == [
        ("s2", "8192")
    ]
    _, every = decode(console.handle_query("SHOW SOCKETS"))
    assert len(every) == 2


def test_stats_report_microseconds_per_database() -> None:
    proxy = FakeProxy()
    pool = make_pool(proxy)
    pool.stats.xact_count, pool.stats.query_count = 2, 5
    pool.stats.xact_time, pool.stats.query_time = 0.004, 0.0025
    pool.total_wait_us = 700
    columns, rows = decode(
        AdminConsole(proxy, "admin", admin=True).handle_query("SHOW STATS_TOTALS")
    )
    app = dict(zip(columns, next(r for r in rows if r[0] == "app"), strict=True))
    assert (app["xact_count"], app["query_count"]) == ("2", "5")
    assert (app["xact_time"], app["query_time"], app["wait_time"]) == ("4000", "2500", "700")
