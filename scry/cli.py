"""The ``scry`` command line.

Thin on purpose: each command builds a :class:`~scry.config.Config` and calls
into a module. Heavy modules are imported inside the commands so that
``scry --help`` stays fast. Exit codes: 0 ok, 1 user error (bad config),
2 usage error (Typer's default).
"""

from __future__ import annotations

import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from scry import __version__

if TYPE_CHECKING:
    from scry.config import Config

app = typer.Typer(
    name="scry",
    help="A PostgreSQL connection pooler and proxy that tells you why your database is struggling.",
    no_args_is_help=True,
    add_completion=False,
    # Locals can hold passwords and tokens: never print them in a traceback.
    pretty_exceptions_show_locals=False,
)

PgbouncerConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--pgbouncer-config",
        help="Read settings from a pgbouncer.ini instead of YAML (see docs/migrating-from-pgbouncer.md).",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        envvar="SCRY_CONFIG",
        help="YAML config file (settings can also come from SCRY_* env vars).",
        dir_okay=False,
        show_default=False,
    ),
]


class PoolMode(StrEnum):
    """Pool modes accepted on the command line."""

    session = "session"
    transaction = "transaction"
    hybrid = "hybrid"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"scry {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """A PostgreSQL connection pooler and proxy that tells you why your database is struggling."""


def _fail(message: str) -> typer.Exit:
    typer.echo(f"scry: {message}", err=True)
    return typer.Exit(1)


def _load(config_path: Path | None, overrides: dict[str, Any] | None = None) -> Any:
    """Load the config or exit 1 with the message (never a traceback)."""
    from scry.config import ConfigError, load_config

    try:
        return load_config(config_path, overrides=overrides)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from None


@app.command()
def serve(
    config: ConfigOption = None,
    pgbouncer_config: PgbouncerConfigOption = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            help="Worker processes (overrides config `workers`).",
            show_default=False,
        ),
    ] = None,
    replace: Annotated[
        bool,
        typer.Option(
            "--replace",
            help="Rolling restart: take over the listening sockets of the scry serving "
            "this port; it drains, waiting for its clients to leave.",
        ),
    ] = False,
    worker_id: Annotated[
        int | None, typer.Option("--worker-id", min=0, hidden=True, show_default=False)
    ] = None,
    instance: Annotated[
        int | None, typer.Option("--instance", min=1, hidden=True, show_default=False)
    ] = None,
    restarted: Annotated[bool, typer.Option("--restarted", hidden=True)] = False,
) -> None:
    """Run the proxy in the foreground; logs go to stderr."""
    if pgbouncer_config is not None:
        raise typer.Exit(_serve_pgbouncer(pgbouncer_config, config, workers, replace))
    overrides = {"workers": workers} if workers is not None else None
    cfg = _load(config, overrides)
    config_path = str(config) if config is not None else None

    from scry.workers import WorkerIdentity, resolve_workers, run_worker

    if worker_id is not None:  # started by the supervisor (scry.workers)
        ident = WorkerIdentity(
            worker_id, workers or 1, instance or os.getppid(), replace, restarted=restarted
        )
        raise typer.Exit(run_worker(cfg, config_path, ident))
    try:
        resolve_workers(cfg)  # a budget that cannot be divided is a config error
    except ValueError as exc:
        raise _fail(f"config error: {exc}") from None
    from scry.proxy import run_proxy

    # run_proxy starts the supervisor when the config asks for several workers.
    if replace:
        raise typer.Exit(run_proxy(cfg, config_path, replace=True))
    raise typer.Exit(run_proxy(cfg, config_path))


def _load_pgbouncer(ini: Path, config: Path | None) -> tuple[Config, list[str]]:
    """A pgbouncer.ini's Config and what scry does not honour of it (also
    printed to stderr)."""
    from scry.pgbouncer.ini import IniError, load_pgbouncer_config

    if config is not None:
        raise _fail(
            "use either --config or --pgbouncer-config (a [scry] section in the ini sets scry-only keys)"
        )
    try:
        cfg, warnings = load_pgbouncer_config(ini)
    except IniError as exc:
        raise _fail(f"config error: {exc}") from None
    for warning in warnings:
        typer.echo(f"scry: {warning}", err=True)
    return cfg, warnings


def _serve_pgbouncer(ini: Path, config: Path | None, workers: int | None, replace: bool) -> int:
    """``scry serve --pgbouncer-config``: the same conversion as scry-pgbouncer
    (``--workers`` as its ``[scry] workers``)."""
    from scry.pgbouncer.account import AccountError, find_account
    from scry.pgbouncer.cli import _setup_logging, run
    from scry.workers import resolve_workers

    cfg, warnings = _load_pgbouncer(ini, config)
    if workers is not None:
        cfg = cfg.model_copy(update={"workers": workers})
    try:
        resolve_workers(cfg)  # a budget that cannot be divided is a config error
    except ValueError as exc:
        raise _fail(f"config error: {exc}") from None
    try:
        account = find_account(cfg.pgbouncer.user) if cfg.pgbouncer.user else None
    except AccountError as exc:
        raise _fail(str(exc)) from None
    _setup_logging(cfg, quiet=False, logfile=cfg.pgbouncer.logfile, owner=account)
    return run(cfg, warnings, account, replace=replace)


@app.command("check-config")
def check_config(
    config: ConfigOption = None, pgbouncer_config: PgbouncerConfigOption = None
) -> None:
    """Validate the config and print the effective settings (secrets masked).
    With --pgbouncer-config: what scry makes of a pgbouncer.ini, and what of
    it scry does not honour."""
    import yaml

    from scry.auth import AuthPolicy
    from scry.config import ConfigError
    from scry.tls import client_tls, server_tls

    if pgbouncer_config is None:
        cfg = _load(config)
    else:
        cfg, _ = _load_pgbouncer(pgbouncer_config, config)
    try:
        AuthPolicy.from_config(cfg)  # the auth_file and auth_hba_file, read as serve reads them
        client_tls(cfg.tls), server_tls(cfg.tls)  # certificates, TLS versions and ciphers
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from None
    typer.echo(
        yaml.safe_dump(cfg.masked_dict(), sort_keys=False, default_flow_style=False), nl=False
    )
    typer.echo("config ok")


@app.command()
def demo(
    duration: Annotated[
        float, typer.Option("--duration", min=0, help="Seconds to run; 0 = until Ctrl-C.")
    ] = 0,
    clients: Annotated[
        int, typer.Option("--clients", min=1, help="Synthetic workload clients.")
    ] = 8,
    mode: Annotated[
        PoolMode, typer.Option("--mode", help="Pool mode of the demo proxy.")
    ] = PoolMode.transaction,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port the demo proxy listens on.")
    ] = 6432,
) -> None:
    """Throwaway PostgreSQL + proxy + synthetic workload + console; all removed on exit."""
    from scry.demo import run_demo

    raise typer.Exit(run_demo(duration=duration, clients=clients, mode=mode.value, port=port))


@app.command()
def tail(
    target: Annotated[
        str | None,
        typer.Argument(
            envvar="SCRY_TARGET",
            help="Admin endpoint: http://host:port or host:port (default http://127.0.0.1:6480).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    fingerprint: Annotated[
        str | None,
        typer.Option(
            "--fingerprint", envvar="SCRY_TAIL_FINGERPRINT", help="Only this fingerprint."
        ),
    ] = None,
    min_ms: Annotated[
        float | None,
        typer.Option(
            "--min-ms", min=0, envvar="SCRY_TAIL_MIN_MS", help="Only statements slower than this."
        ),
    ] = None,
    errors: Annotated[bool, typer.Option("--errors", help="Only failed statements.")] = False,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="SCRY_ADMIN_TOKEN", help="Admin token.", show_default=False),
    ] = None,
) -> None:
    """Stream anonymized query events to stdout, one per line; Ctrl-C ends it."""
    from admin import parse_target
    from scry.tail import tail_main

    try:
        parse_target(target)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(
        tail_main(
            target, token, as_json=as_json, fingerprint=fingerprint, min_ms=min_ms, errors=errors
        )
    )


# --- the console (scry_tui, imported lazily) -------------------------------------------

TargetsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help="Admin endpoints: http://host:port, host:port or "
        "ssh://[user@]host[:22]/ADMIN_HOST:ADMIN_PORT. Default: the fleet file "
        "(~/.config/scry/fleet.yaml), else http://127.0.0.1:6480.",
        show_default=False,
    ),
]
FleetOption = Annotated[
    Path | None,
    typer.Option(
        "--fleet",
        envvar="SCRY_FLEET",
        help="Fleet file listing named targets and their tokens (see docs/console.md).",
        dir_okay=False,
        show_default=False,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="SCRY_ADMIN_TOKEN", help="Admin token for TARGETs.", show_default=False
    ),
]
ReadOnlyOption = Annotated[
    bool,
    typer.Option(
        "--read-only",
        envvar="SCRY_CONSOLE_READ_ONLY",
        help="Hide and refuse destructive actions (unpin, kill, trip, reset).",
    ),
]
RefreshOption = Annotated[
    float | None,
    typer.Option(
        "--refresh",
        min=0.2,
        envvar="SCRY_CONSOLE_REFRESH",
        help="Seconds between polls (default 2; + and - change it live).",
        show_default=False,
    ),
]
ScreenshotDirOption = Annotated[
    Path | None,
    typer.Option(
        "--screenshot-dir",
        envvar="SCRY_SCREENSHOT_DIR",
        help="Where ctrl+s saves SVG screenshots (default: the current directory).",
        file_okay=False,
        show_default=False,
    ),
]


def _console(
    view: str,
    targets: list[str] | None,
    fleet: Path | None,
    token: str | None,
    read_only: bool,
    refresh: float | None,
    screenshot_dir: Path | None,
) -> int:
    from scry_tui.launch import run_console

    return run_console(
        targets,
        view=view,
        token=token,
        fleet_file=fleet,
        read_only=read_only,
        refresh=refresh,
        screenshot_dir=screenshot_dir,
    )


@app.command()
def top(
    targets: TargetsArgument = None,
    fleet: FleetOption = None,
    token: TokenOption = None,
    read_only: ReadOnlyOption = False,
    refresh: RefreshOption = None,
    screenshot_dir: ScreenshotDirOption = None,
) -> None:
    """The console, opened on the fingerprint ranking."""
    raise typer.Exit(_console("top", targets, fleet, token, read_only, refresh, screenshot_dir))


@app.command()
def console(
    targets: TargetsArgument = None,
    fleet: FleetOption = None,
    token: TokenOption = None,
    read_only: ReadOnlyOption = False,
    refresh: RefreshOption = None,
    screenshot_dir: ScreenshotDirOption = None,
) -> None:
    """The console, opened on the fleet overview."""
    raise typer.Exit(_console("fleet", targets, fleet, token, read_only, refresh, screenshot_dir))


@app.command()
def screenshot(
    targets: TargetsArgument = None,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            envvar="SCRY_SCREENSHOT_OUT",
            help="Directory for the SVG files (created if missing).",
            file_okay=False,
        ),
    ] = Path("screenshots"),
    view: Annotated[
        str,
        typer.Option(
            "--view",
            envvar="SCRY_SCREENSHOT_VIEWS",
            help="Comma-separated views: fleet,top,tail,pools,pins,breaker,hot.",
        ),
    ] = "fleet,top,tail,pools,pins,breaker,hot",
    fleet: FleetOption = None,
    token: TokenOption = None,
    size: Annotated[
        str, typer.Option("--size", envvar="SCRY_SCREENSHOT_SIZE", help="COLUMNSxROWS.")
    ] = "160x44",
    settle: Annotated[
        float,
        typer.Option("--settle", min=0, help="Seconds to let data (and the tail) arrive per view."),
    ] = 2.0,
) -> None:
    """Headless: render console views to SVG files (timestamp and targets in the frame)."""
    from scry_tui.launch import run_screenshots

    try:
        cols, rows = (int(n) for n in size.lower().split("x"))
    except ValueError:
        raise _fail(f"--size must be COLUMNSxROWS, not {size!r}") from None
    views = [v.strip() for v in view.split(",") if v.strip()]
    raise typer.Exit(
        run_screenshots(
            targets,
            out=out,
            views=views,
            token=token,
            fleet_file=fleet,
            size=(cols, rows),
            settle=settle,
        )
    )


events_app = typer.Typer(help="Read per-query event files written by the file sink.")
app.add_typer(events_app, name="events")


@events_app.command("read")
def events_read(
    path: Annotated[Path, typer.Argument(help="An events file (observability.events.path).")],
) -> None:
    """Print the events of FILE as JSON lines."""
    from scry.observe.events import events_read_main

    raise typer.Exit(events_read_main(str(path)))


def main() -> None:
    """Console-script entry point (``scry``)."""
    app(prog_name="scry")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
