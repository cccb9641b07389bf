"""``scry demo``: a throwaway PostgreSQL, scry in front of it, and a workload.

Everything runs in this process and on one event loop: a :class:`DevCluster`
(removed again on exit), the proxy (:class:`~scry.proxy.Proxy`) and the
synthetic e-commerce workload of :mod:`scry.workload`. A status panel is
redrawn once per second until Ctrl-C or ``--duration`` seconds.

The panel lives in :func:`render_status` only, so that a richer console can
replace it without touching the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from scry.devcluster import DevCluster, DevClusterError, free_port
from scry.event_loop import run as run_loop
from scry.workload import (
    KINDS,
    WorkloadError,
    WorkloadSnapshot,
    WorkloadStats,
    load_schema,
    require_psycopg,
    run_workload,
)

if TYPE_CHECKING:
    from scry.config import Config
    from scry.proxy import Proxy

__all__ = ["DemoInfo", "render_status", "run_demo"]

POOL_SIZE = 10
REFRESH_SECONDS = 1.0
WORKLOAD_STOP_TIMEOUT = 5.0
LOG_LINES = 4  # proxy warnings kept for the panel

_KIND_LABELS = {
    "browse": "browse products",
    "product": "product by id",
    "search": "text search",
    "history": "order history",
    "order": "order details",
    "checkout": "checkout (tx)",
    "slow": "slow query",
    "error": "failing query",
    "session": "session client",
}


@dataclass
class DemoInfo:
    """What the panel shows besides the numbers."""

    connect: str  # psql command line
    mode: str
    duration: float
    pg_version: str = ""
    log: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    warnings: int = 0


class _LogSink:
    """A file-like stream for :func:`scry.log.setup_logging`: keeps the last lines."""

    def __init__(self, info: DemoInfo) -> None:
        self.info = info

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                self.info.log.append(line)
                self.info.warnings += 1
        return len(text)

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------- #
# The panel
# --------------------------------------------------------------------------- #


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


def render_status(
    snap: WorkloadSnapshot,
    prev: WorkloadSnapshot | None,
    proxy: Proxy,
    info: DemoInfo,
) -> Panel:
    """One frame: the workload per query kind, the proxy's pools, recent warnings."""
    queries = Table(box=None, pad_edge=False, expand=False, header_style="bold")
    queries.add_column("query", min_width=16)
    for col, width in (("q/s", 6), ("total", 9), ("errors", 6), ("p50 ms", 6), ("p99 ms", 6)):
        queries.add_column(col, justify="right", min_width=width)
    for kind in KINDS:
        k = snap.kinds[kind]
        queries.add_row(
            _KIND_LABELS.get(kind, kind),
            f"{snap.rate(prev, kind):,.0f}",
            f"{k.count:,}",
            Text(f"{k.errors:,}", style="red" if k.errors and kind != "error" else ""),
            _ms(k.p50),
            _ms(k.p99),
        )
    queries.add_row(
        Text("all", style="bold"),
        Text(f"{snap.rate(prev):,.0f}", style="bold"),
        Text(f"{snap.total:,}", style="bold"),
        Text(f"{snap.errors:,}", style="bold"),
        Text(_ms(snap.p50), style="bold"),
        Text(_ms(snap.p99), style="bold"),
    )

    pools = Table(box=None, pad_edge=False, expand=False, header_style="bold")
    pools.add_column("pool", min_width=16)
    for col in ("mode", "size", "servers", "active", "idle", "waiting", "opened"):
        pools.add_column(col, justify="right")
    for pool in list(proxy.pools.values()):
        pools.add_row(
            pool.name,
            pool.mode,
            str(pool.size),
            str(len(pool.servers)),
            str(pool.active_count),
            str(len(pool.idle)),
            Text(str(len(pool.waiters)), style="yellow" if pool.waiters else ""),
            str(pool.servers_opened),
        )

    unexpected = snap.unexpected_errors
    summary = Text.assemble(
        ("clients ", "dim"),
        f"{proxy.client_count}",
        (" (workload ", "dim"),
        f"{snap.connected}",
        (")  reconnects ", "dim"),
        (f"{snap.reconnects}", "yellow" if snap.reconnects else ""),
        ("  unexpected errors ", "dim"),
        (f"{unexpected}", "red" if unexpected else ""),
    )
    parts: list[Any] = [queries, Text(""), pools, summary]
    if snap.session_state_lost:
        parts.append(
            Text.assemble(
                ("session state lost ", "dim"),
                (f"{snap.session_state_lost}", "yellow"),
                (" (SET / PREPARE not there on the next server)", "dim"),
            )
        )
    if snap.last_error:
        parts.append(Text(f"last error: {snap.last_error}", style="red", overflow="ellipsis"))
    if info.log:
        parts.append(Text(f"proxy warnings ({info.warnings}):", style="yellow"))
        parts.extend(
            Text(line, style="dim", overflow="ellipsis", no_wrap=True) for line in info.log
        )
    parts.append(Text.assemble(("connect: ", "dim"), (info.connect, "bold cyan")))

    elapsed = f"{snap.elapsed:.0f}s"
    if info.duration:
        elapsed += f" / {info.duration:.0f}s"
    title = f"scry demo - {info.mode} pooling - {elapsed}"
    subtitle = "Ctrl-C to stop" if not info.duration else None
    return Panel(Group(*parts), title=title, subtitle=subtitle, expand=False)


# --------------------------------------------------------------------------- #
# Running it
# --------------------------------------------------------------------------- #


def _config(cluster: DevCluster, mode: str, port: int) -> Config:
    from scry.config import Config

    return Config.model_validate(
        {
            "listen_addr": f"127.0.0.1:{port}",
            "database_url": cluster.dsn(),
            "pool": {"mode": mode, "size": POOL_SIZE},
            "tls": {"server_tls_sslmode": "disable"},
            # A free port (never a clash with a real scry on 6480) and a token, so the
            # console's actions (unpin, trip, ...) work on the demo.
            "admin": {"listen_addr": "127.0.0.1:0", "token": secrets.token_urlsafe(16)},
        }
    )


async def _start_proxy(cluster: DevCluster, mode: str, port: int, console: Console) -> Proxy:
    """Start the proxy on ``port``; a busy port (or 0) means a free one instead."""
    from scry.proxy import Proxy

    wanted = port
    for attempt in range(5):
        if port == 0:
            port = free_port()
        proxy = Proxy(_config(cluster, mode, port))
        try:
            await proxy.start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 4:
                raise
            port = 0
            continue
        if wanted and port != wanted:
            console.print(
                f"[yellow]port {wanted} is in use; scry listens on {port} instead[/yellow]"
            )
        return proxy
    raise AssertionError("unreachable")


def _postmaster_pid(cluster: DevCluster) -> str:
    try:
        return (cluster.data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except OSError:
        return "?"


class _Interrupt:
    """Ctrl-C / SIGTERM seen: a flag while starting up, an event once the loop runs."""

    def __init__(self) -> None:
        self.seen = False
        self.stop: asyncio.Event | None = None

    def __call__(self, *_: Any) -> None:
        self.seen = True
        if self.stop is not None:
            self.stop.set()


async def _demo(
    cluster: DevCluster,
    duration: float,
    clients: int,
    mode: str,
    port: int,
    console: Console,
    interrupt: _Interrupt,
) -> int:
    from scry.log import setup_logging

    loop = asyncio.get_running_loop()
    stop = interrupt.stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    if interrupt.seen:
        stop.set()
    proxy: Proxy | None = None
    workload: asyncio.Task[None] | None = None
    saved_logging: tuple[list[logging.Handler], int, bool] | None = None
    try:
        with console.status("loading the demo schema (customers, products, orders)..."):
            await load_schema(cluster.dsn())
        if stop.is_set():
            console.print("interrupted")
            return 0
        proxy = await _start_proxy(cluster, mode, port, console)
        port = proxy.listen_port
        info = DemoInfo(
            connect=f'psql "postgres://app:app_pass@127.0.0.1:{port}/app"',
            mode=mode,
            duration=duration,
        )
        # The proxy's own log: warnings and errors only, shown in the panel.
        scry_logger = logging.getLogger("scry")
        saved_logging = (scry_logger.handlers[:], scry_logger.level, scry_logger.propagate)
        setup_logging("warning", "text", stream=_LogSink(info))
        console.print(f"scry is listening on [bold]127.0.0.1:{port}[/bold] ({mode} pooling)")
        console.print(f"connect with: [bold cyan]{info.connect}[/bold cyan]")

        stats = WorkloadStats()
        proxy_dsn = f"postgresql://app:app_pass@127.0.0.1:{port}/app"
        workload = asyncio.create_task(
            run_workload(proxy_dsn, clients, duration or None, stats, stop)
        )
        prev: WorkloadSnapshot | None = None
        snap = stats.snapshot()
        if _console_wanted(console, duration) and proxy.admin is not None:
            await _run_console(proxy, stop, workload)
        else:
            with Live(
                render_status(snap, None, proxy, info),
                console=console,
                auto_refresh=False,
                transient=False,
                redirect_stderr=False,
            ) as live:
                while not stop.is_set() and not workload.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), REFRESH_SECONDS)
                    prev, snap = snap, stats.snapshot()
                    live.update(render_status(snap, prev, proxy, info), refresh=True)
            if not console.is_terminal:
                console.line()  # Live leaves its last frame without a newline here
        stop.set()
        try:
            await asyncio.wait_for(workload, WORKLOAD_STOP_TIMEOUT)
        except TimeoutError:
            console.print("[yellow]workload did not stop in time; cancelled[/yellow]")
        snap = stats.snapshot()
        rate = snap.total / snap.elapsed if snap.elapsed else 0.0
        console.print(
            f"ran {snap.total} queries in {snap.elapsed:.1f}s ({rate:,.0f} q/s through scry), "
            f"{snap.errors} errors ({snap.deliberate_errors} deliberate, "
            f"{snap.unexpected_errors} unexpected), "
            f"session state lost {snap.session_state_lost} times"
            + (" (interrupted)" if interrupt.seen else "")
        )
        if info.warnings:
            console.print(f"[yellow]scry logged {info.warnings} warnings; the last ones:[/yellow]")
            for line in info.log:
                console.print(Text(line, style="dim"))
        return 0
    finally:
        if workload is not None and not workload.done():
            workload.cancel()
            with contextlib.suppress(BaseException):
                await workload
        if proxy is not None:
            proxy.stop_now()
            await asyncio.sleep(0)  # let the transports close
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if saved_logging is not None:
            logger = logging.getLogger("scry")
            logger.handlers[:], level, logger.propagate = saved_logging
            logger.setLevel(level)


def _console_wanted(console: Console, duration: float) -> bool:
    """The interactive console replaces the panel on a terminal, until the operator quits.

    ``--duration`` runs and non-terminal output (tests, pipes) keep the panel.
    """
    return not duration and console.is_terminal and sys.stdin.isatty()


async def _run_console(proxy: Proxy, stop: asyncio.Event, workload: asyncio.Task[None]) -> None:
    """Run the scry console (scry_tui) on the demo proxy's admin API, in this event loop.

    Quitting the console (q) ends the demo; so do Ctrl-C and SIGTERM (``stop``)
    and the workload ending.
    """
    from scry_tui.app import ScryConsole
    from scry_tui.targets import make_target

    assert proxy.admin is not None
    target = make_target(
        f"http://{proxy.admin.address}", name="demo", token=proxy.config.admin.token
    )
    app = ScryConsole([target], view="top", refresh=1.0)

    async def watch() -> None:
        done = asyncio.create_task(stop.wait())
        await asyncio.wait({done, workload}, return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        app.exit()

    watcher = asyncio.create_task(watch())
    try:
        await app.run_async()
    finally:
        watcher.cancel()
        stop.set()


def _error(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(message, style="red"))


def run_demo(
    duration: float = 0, clients: int = 8, mode: str = "transaction", port: int = 6432
) -> int:
    """Run the demo until Ctrl-C (``duration`` 0) or for ``duration`` seconds; exit code."""
    console = Console(highlight=False, soft_wrap=True)
    try:
        psycopg = require_psycopg()
    except WorkloadError as exc:
        _error(f"scry demo: {exc}")
        return 1
    # Ctrl-C or SIGTERM while PostgreSQL starts is only noted: interrupting
    # initdb or pg_ctl half-way would leave a server or files behind. The demo
    # stops as soon as the cluster can be stopped cleanly.
    interrupt = _Interrupt()
    old_int = signal.signal(signal.SIGINT, interrupt)
    old_term = signal.signal(signal.SIGTERM, interrupt)
    cluster: DevCluster | None = None
    started = False
    try:
        try:
            cluster = DevCluster(ssl=False, prefix="scry-demo-")
            with console.status("starting a throwaway PostgreSQL..."):
                cluster.start()
            started = True
        except DevClusterError as exc:
            _error(f"scry demo: {exc}")
            return 1
        version = cluster.psql("SHOW server_version").split()[0]
        console.print(
            f"PostgreSQL {version} on 127.0.0.1:{cluster.port} "
            f"(data dir {cluster.data_dir}, pid {_postmaster_pid(cluster)})"
        )
        if interrupt.seen:
            console.print("interrupted")
            return 0
        return run_loop(_demo(cluster, duration, clients, mode, port, console, interrupt))
    except KeyboardInterrupt:  # pragma: no cover - signals are handled above
        console.print("interrupted")
        return 0
    except (DevClusterError, WorkloadError, OSError, psycopg.Error) as exc:
        _error(f"scry demo: {exc}")
        return 1
    finally:
        # Further signals must not leave PostgreSQL behind half-stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if cluster is not None and started:
            with console.status("stopping PostgreSQL and removing its files..."):
                cluster.stop()
            gone = "removed" if not cluster.base_dir.exists() else "could not remove"
            console.print(f"stopped PostgreSQL and {gone} {cluster.base_dir}")
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
