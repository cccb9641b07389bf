"""``scry-pgbouncer``: PgBouncer's command line, running scry.

    scry-pgbouncer [-d] [-q] [-v] [-R] [-u USER] [-V] [-h] pgbouncer.ini

argparse rather than Typer here: the point is to accept exactly PgBouncer's
switches. The pgbouncer.ini is converted by :mod:`scry.pgbouncer.ini`; every
setting scry does not honour is printed once at start. ``logfile`` and
``pidfile`` are honoured; ``-d`` daemonizes (double fork) and, as PgBouncer,
needs ``pidfile`` and ``logfile``. ``user`` (or ``-u``) switches a process
started as root to that user before it listens (scry.pgbouncer.account).

Signals are PgBouncer's: SIGHUP re-reads the pgbouncer.ini (RELOAD), SIGINT
waits for servers (SHUTDOWN WAIT_FOR_SERVERS), SIGTERM waits for clients
(SHUTDOWN WAIT_FOR_CLIENTS), SIGQUIT (or a second SIGINT/SIGTERM) stops at
once, SIGUSR1 pauses and SIGUSR2 resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pwd
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from scry import __version__, systemd
from scry.log import event, logger, setup_logging
from scry.pgbouncer.account import AccountError, become, find_account, hand_over
from scry.workers import WorkerIdentity, resolve_workers

PROG = "scry-pgbouncer"
USAGE = f"""{PROG} is a PostgreSQL connection pooler (scry, PgBouncer-compatible).

Usage:
  {PROG} [OPTION]... CONFIG_FILE

Options:
  -d, --daemon         run in background (as a daemon)
  -q, --quiet          run quietly
  -R, --reboot         do an online reboot (not supported by scry: see --replace)
      --replace        rolling restart: take over the listening socket of the
                       scry serving this port, which then waits for its
                       clients to leave and exits
  -u, --user=USERNAME  assume identity of USERNAME
  -v, --verbose        increase verbosity
  -V, --version        show version, then exit
  -h, --help           show this help, then exit
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, usage=USAGE)
    parser.add_argument("-d", "--daemon", action="store_true")
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("-R", "--reboot", action="store_true")
    parser.add_argument("--replace", action="store_true")
    parser.add_argument("-u", "--user")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("-V", "--version", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("config", nargs="?")
    # A worker started by the supervisor of an instance with ``[scry] workers``.
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--instance", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--restarted", action="store_true", help=argparse.SUPPRESS)
    return parser


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.help:
        print(USAGE, end="")
        return 0
    if args.version:
        from scry.pgbouncer import PGBOUNCER_VERSION

        print(f"{PROG} {__version__} (scry; PgBouncer {PGBOUNCER_VERSION} compatible)")
        return 0
    if args.reboot:
        return _fail(
            "-R (online reboot) is deprecated in PgBouncer and not supported: start the new "
            "process with --replace instead (it takes the listening socket over; the old "
            "one keeps its clients until they leave)"
        )
    if not args.config:
        return _fail("need config file", 2)

    from scry.pgbouncer.ini import IniError, load_pgbouncer_config

    try:
        config, warnings = load_pgbouncer_config(args.config)
    except IniError as exc:
        return _fail(f"config error: {exc}")
    compat = config.pgbouncer
    assert compat is not None
    account = None
    if args.user or compat.user:  # -u wins over the ini, as in PgBouncer
        try:
            account = find_account(args.user or compat.user)
        except AccountError as exc:
            return _fail(str(exc))
    try:
        resolve_workers(config)  # a budget that cannot be divided is a config error
    except ValueError as exc:
        return _fail(f"config error: {exc}")
    if args.daemon and not compat.pidfile:
        return _fail("daemon mode needs pidfile configured")
    if args.daemon and not compat.logfile:
        return _fail("daemon mode needs logfile configured")
    if args.verbose:
        config = config.model_copy(update={"log": config.log.model_copy(update={"level": "debug"})})
    if args.worker_id is not None:  # the supervisor printed the warnings, and owns the pidfile
        identity = WorkerIdentity(
            args.worker_id, args.workers, args.instance, args.replace, restarted=args.restarted
        )
        _setup_logging(config, quiet=args.quiet, logfile=compat.logfile, owner=account)
        return run(config, warnings, account, verbose=args.verbose, identity=identity)
    for warning in warnings:
        if not args.quiet:
            print(f"{PROG}: {warning}", file=sys.stderr)
    pidfile = compat.pidfile
    if pidfile and not args.replace:  # (with --replace, that instance is leaving)
        problem = _check_pidfile(pidfile)
        if problem:
            return _fail(problem)
    if args.daemon:
        _daemonize()
    if pidfile:
        Path(pidfile).write_text(f"{os.getpid()}\n")
        hand_over(pidfile, account)
    try:
        _setup_logging(
            config, quiet=args.quiet or args.daemon, logfile=compat.logfile, owner=account
        )
        for warning in warnings:
            event(warning, logging.WARNING)
        flags = ["-q"] if args.quiet or args.daemon else []
        flags += ["-v"] * args.verbose + (["-u", args.user] if args.user else [])
        return run(
            config, warnings, account, replace=args.replace, verbose=args.verbose, flags=flags
        )
    finally:
        if pidfile:
            with contextlib.suppress(OSError):
                if Path(pidfile).read_text().strip() == str(os.getpid()):
                    os.unlink(pidfile)


def _check_pidfile(path: str) -> str | None:
    """PgBouncer refuses to start over a live pidfile; a stale one is replaced."""
    try:
        pid = int(Path(path).read_text().strip() or 0)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return f"pidfile {path} exists and process {pid} is running: another instance?"


def _daemonize() -> None:
    """Double fork, new session, standard streams to /dev/null (cwd is kept:
    relative paths in the pgbouncer.ini stay valid)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _setup_logging(  # type: ignore[no-untyped-def]
    config, *, quiet: bool, logfile: str | None, owner: pwd.struct_passwd | None = None
) -> None:
    made = bool(logfile) and not os.path.exists(logfile)  # (an existing one keeps its owner)
    setup_logging(
        config.log.level, config.log.format, path=logfile if quiet else None,
        syslog=config.log.syslog_target(),
    )  # fmt: skip
    if logfile and not quiet:  # PgBouncer: logfile does not turn off stderr; -q does
        handler = logging.FileHandler(logfile)
        handler.setFormatter(logger.handlers[0].formatter)
        logger.addHandler(handler)
    elif quiet and not logfile:
        logger.handlers[0] = logging.NullHandler()  # (stderr; a syslog handler stays)
    if made and logfile:
        hand_over(logfile, owner)


def run(  # type: ignore[no-untyped-def]
    config,
    warnings: list[str] | None = None,
    account: pwd.struct_passwd | None = None,
    *,
    replace: bool = False,
    verbose: int = 0,
    identity: WorkerIdentity | None = None,
    flags: Sequence[str] = (),
) -> int:
    """Serve ``config`` (from a pgbouncer.ini) until a signal stops it, as
    ``account`` once the configuration is read; ``replace``: take over the
    listening sockets of the scry serving the port (``--replace``);
    ``verbose``: how many ``-v`` (kept over the ini's ``verbose`` by reloads).

    With ``[scry] workers`` (or ``scry serve --workers``) above 1 this process
    is the supervisor (scry.workers) of that many workers, each this command
    with ``flags`` (``-q``, ``-v``, ``-u``) and its ``identity``."""
    from scry.event_loop import run as run_loop

    if identity is None:
        workers = resolve_workers(config)
        if workers > 1:
            return _supervise(config, workers, replace, flags)
        identity = WorkerIdentity(instance=os.getpid(), replace=replace)
    return run_loop(serve(config, warnings or [], account, identity, verbose))


def _supervise(config, workers: int, replace: bool, flags: Sequence[str]) -> int:  # type: ignore[no-untyped-def]
    """The supervisor of an instance of scry-pgbouncer workers. It forwards
    PgBouncer's signals: SIGHUP, SIGUSR1 and SIGUSR2 to every worker; SIGINT,
    SIGTERM and SIGQUIT too, after which no worker is restarted."""
    from scry.workers import Supervisor, worker_arguments

    ini = config.pgbouncer.conffile

    def command(identity: WorkerIdentity) -> list[str]:
        return [sys.executable, "-m", "scry.pgbouncer.cli", *flags,
                *worker_arguments(identity), ini]  # fmt: skip

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
    supervisor = Supervisor(config, None, workers, replace, command=command, stop_signals=stops)
    return asyncio.run(supervisor.run())


async def serve(  # type: ignore[no-untyped-def]
    config,
    warnings: list[str],
    account: pwd.struct_passwd | None = None,
    identity: WorkerIdentity | None = None,
    verbose: int = 0,
) -> int:
    """Run a proxy from a pgbouncer.ini config with PgBouncer's signals."""
    from scry.config import ConfigError
    from scry.pgbouncer.commands import resume_all
    from scry.pgbouncer.console import reload_pgbouncer_config, remove_unix_socket, state_for
    from scry.proxy import Proxy, freeze_startup_heap
    from scry.workers import join_instance

    identity = join_instance(identity or WorkerIdentity(instance=os.getpid()))
    proxy = Proxy(config, None, identity)  # (reads auth_file, hba and TLS files while still root)
    if account is not None:
        try:
            become(account)
        except OSError as exc:
            event("cannot switch user", logging.ERROR, user=account.pw_name, error=str(exc))
            return 1
        event("switched user", user=account.pw_name, uid=account.pw_uid)
    elif os.geteuid() == 0:
        # PgBouncer refuses to start as root; refusing would break setups
        # (containers, CI) that run scry that way, so it is said once instead.
        event("running as root: set user in the ini (or start as another user)", logging.WARNING)
    state = state_for(proxy)
    state.warned.update(warnings)
    if verbose:  # (as a SET would be: a reload keeps it, SHOW CONFIG shows it)
        state.overrides["verbose"] = str(verbose)

    def apply_ini() -> None:
        try:
            reload_pgbouncer_config(proxy)
        except ConfigError as exc:  # (an IniError, or one it cannot apply)
            event("reload failed; keeping the running config", logging.ERROR, error=str(exc))

    def reload() -> None:
        systemd.reload(apply_ini)

    state.reload = reload
    loop = asyncio.get_running_loop()

    def pause() -> None:
        state.paused_all = True
        loop.create_task(proxy.pause())

    # Before the listener opens: a SIGHUP (or SIGUSR1/2) sent as soon as the
    # port answers must be handled, not kill the process (the default action).
    loop.add_signal_handler(signal.SIGHUP, reload)
    loop.add_signal_handler(signal.SIGUSR1, pause)
    loop.add_signal_handler(signal.SIGUSR2, resume_all, proxy)  # from PAUSE or SUSPEND
    if identity.restarted:
        # Started again after a crash: PAUSE, SET... as the other workers have
        # them, before the port is shared with them again (it is theirs alone
        # until then), so no client is served in the ini's state.
        await _adopt_console_state(proxy)
    try:
        await proxy.start()
    except OSError as exc:
        event("cannot listen", logging.ERROR, addr=config.listen_addr, error=str(exc))
        return 1
    freeze_startup_heap()
    systemd.notify("READY=1", f"STATUS=listening on {config.listen_addr}")
    stops = {"count": 0}

    def stop(signame: str, wait_for_clients: bool) -> None:
        stops["count"] += 1
        systemd.notify("STOPPING=1")
        if stops["count"] > 1 or signame == "SIGQUIT":
            event("signal received: stopping now", signal=signame)
            proxy.stop_now()
            return
        state.shutting_down = True
        if wait_for_clients:
            event("signal received: waiting for clients to leave", signal=signame)
            for listener in proxy.listeners:
                listener.close()
            loop.create_task(_stop_when_no_clients(proxy))
        else:
            event("signal received: waiting for servers to be released", signal=signame)
            proxy.begin_drain()

    loop.add_signal_handler(signal.SIGINT, stop, "SIGINT", False)
    loop.add_signal_handler(signal.SIGTERM, stop, "SIGTERM", True)
    loop.add_signal_handler(signal.SIGQUIT, stop, "SIGQUIT", False)
    await proxy.wait_stopped()
    if proxy.admin is not None:
        await proxy.admin.stop()
    await proxy.observatory.stop()
    remove_unix_socket(proxy)  # PgBouncer removes its socket file at exit
    event("stopped")
    return 0


async def _adopt_console_state(proxy) -> None:  # type: ignore[no-untyped-def]
    from scry.pgbouncer.instance import adopt_console_state

    try:
        await adopt_console_state(proxy)
    except Exception as exc:  # (an ini that no longer reads, a worker's odd answer)
        event("could not take the console's state from the other workers", logging.ERROR,
              error=repr(exc))  # fmt: skip


async def _stop_when_no_clients(proxy) -> None:  # type: ignore[no-untyped-def]
    while proxy.clients:  # noqa: ASYNC110 - polled, as Proxy._drain does
        await asyncio.sleep(0.05)
    proxy.stop_now()


def entry() -> None:
    """``scry-pgbouncer`` console script."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    entry()
