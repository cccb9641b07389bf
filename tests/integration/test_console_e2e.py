"""The console end to end: a real ``scry serve`` in front of a real PostgreSQL,
under a small workload, watched by the Textual app (headless, through the
admin API only), and ``scry screenshot`` writing SVGs of it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from textual.widgets import DataTable

from scry.devcluster import free_port
from scry_tui.app import ScryConsole
from scry_tui.screens import DetailScreen
from scry_tui.targets import make_target
from scry_tui.testing import refreshed
from scry_tui.views import TailView

TOKEN = "t0k-console"
SCRY = Path(sys.executable).with_name("scry")
MARKER = "console_e2e_marker"


def start_admin_proxy(scry_proxy):
    port = free_port()
    proxy = scry_proxy(
        {
            "pool": {"mode": "hybrid", "size": 4},
            "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{port}", "token": TOKEN},
        }
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    return proxy, base


@pytest.fixture
def admin_proxy(scry_proxy):
    return start_admin_proxy(scry_proxy)


@contextmanager
def workload(proxy) -> Iterator[threading.Event]:
    """Two clients: one runs a recognizable SELECT in a loop, one holds a pin (SET)."""
    stop = threading.Event()

    def run() -> None:
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(f"SELECT {MARKER}.n FROM (SELECT 42 AS n) AS {MARKER}").fetchall()
                time.sleep(0.01)

    def pin() -> None:
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
            conn.execute("SET work_mem = '8MB'")
            stop.wait(60)

    threads = [threading.Thread(target=run, daemon=True), threading.Thread(target=pin, daemon=True)]
    for t in threads:
        t.start()
    try:
        yield stop
    finally:
        stop.set()
        for t in threads:
            t.join(10)


async def test_console_watches_a_real_proxy(admin_proxy) -> None:
    proxy, base = admin_proxy
    app = ScryConsole([make_target(base, name="local", token=TOKEN)], view="top", refresh=0.5)
    with workload(proxy):
        async with app.run_test(size=(160, 44)) as pilot:
            top = app.query_one("#top")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                await refreshed(pilot, app, 1)
                if any(MARKER in r.query.query for r in top.rows.values()):
                    break
            assert app.states["local"].up, app.states["local"].last_error
            row = next(r for r in top.rows.values() if MARKER in r.query.query)
            assert "42" not in row.query.query  # normalized/anonymized: no literal
            # The detail pane's live tail shows only this fingerprint.
            table = app.query_one("#top-table", DataTable)
            table.move_cursor(row=table.get_row_index(row.query.fingerprint))
            await pilot.press("enter")
            assert isinstance(app.screen, DetailScreen)
            deadline = time.monotonic() + 10
            while not app.screen.samples and time.monotonic() < deadline:
                await pilot.pause(0.1)
            assert app.screen.samples
            assert {e.fingerprint for e in app.screen.samples} == {row.query.fingerprint}
            await pilot.press("escape", "3")
            tail = app.query_one(TailView)
            deadline = time.monotonic() + 10
            while tail.total == 0 and time.monotonic() < deadline:
                await pilot.pause(0.1)
            assert tail.total > 0
            # Fleet, pools and pins come from the same proxy.
            await pilot.press("1")
            await refreshed(pilot, app, 1)
            assert app.states["local"].pools is not None
            await pilot.press("5")
            await refreshed(pilot, app, 1)
            pins = app.states["local"].pins
            assert pins is not None and any("set" in p.reasons for p in pins.pins)


async def test_console_merges_two_real_proxies_percentiles(scry_proxy) -> None:
    """One slow pg_sleep through proxy a, 150 fast ones through b: the merged
    Top row counts 151 calls and its p99 is a fast call's, though a's own p99
    is the slow one (the worst proxy's p99, which the console showed before)."""
    (a, base_a), (b, base_b) = start_admin_proxy(scry_proxy), start_admin_proxy(scry_proxy)
    with psycopg.connect(**a.conninfo(), autocommit=True) as conn:
        conn.execute("select pg_sleep(0.2)")
    with psycopg.connect(**b.conninfo(), autocommit=True) as conn:
        for _ in range(150):
            conn.execute("select pg_sleep(0)")
    targets = [
        make_target(base_a, name="a", token=TOKEN),
        make_target(base_b, name="b", token=TOKEN),
    ]
    app = ScryConsole(targets, view="top", refresh=0.5)
    async with app.run_test(size=(160, 44)) as pilot:
        top = app.query_one("#top")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            await refreshed(pilot, app, 1)
            rows = [r for r in top.rows.values() if "pg_sleep" in r.query.query]
            if rows and rows[0].query.calls == 151:
                break
        (row,) = rows
        assert row.query.calls == 151 and row.proxies == ("a", "b")
        assert row.query.max_ms >= 200
        assert row.query.p99_ms < 50
        own_a = next(q for q in app.states["a"].top.queries if "pg_sleep" in q.query)
        assert own_a.p99_ms >= 200


def test_scry_screenshot_of_a_real_proxy(admin_proxy, tmp_path: Path) -> None:
    proxy, base = admin_proxy
    out = tmp_path / "shots"  # tmp_path also holds the proxy's config and log
    with workload(proxy):
        result = subprocess.run(
            [str(SCRY), "screenshot", base, "--out", str(out), "--view", "top,tail",
             "--settle", "1", "--token", TOKEN],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert [f.split("-")[1] for f in files] == ["tail", "top"]
    svg = (out / files[1]).read_text()
    assert MARKER in svg and base.replace("http://", "") in svg.replace("&#160;", " ")


def test_scry_console_without_a_terminal_and_bad_targets() -> None:
    result = subprocess.run(
        [str(SCRY), "console", "ftp://nope:1"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1 and "unsupported target scheme" in result.stderr
    result = subprocess.run(
        [str(SCRY), "top", "127.0.0.1:1"], capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 1 and "needs a terminal" in result.stderr
