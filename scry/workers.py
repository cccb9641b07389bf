"""Worker processes: fleet budgets, worker identity, and the supervisor.

``scry serve`` with ``workers: N`` (N > 1, or ``auto``) runs a supervisor and
N worker processes. Each worker is a whole scry (``scry.proxy.Proxy`` on its
own uvloop) that binds the same listen address with ``SO_REUSEPORT``; the
kernel spreads new connections across them. The supervisor accepts no
connections. It::

    starts the workers ──► watches them ──► restarts one that dies (backoff)
         ▲                     │
         │ SIGHUP/SIGINT/SIGTERM forwarded to every worker
         └── exits when every worker has exited on purpose (exit code 0)

Budgets are fleet budgets: :func:`share` divides ``pool.size``, ``min_size``,
``reserve_size``, ``max_client_conn`` and the connection limits (top level and
per database) so that the workers together never exceed what the config says. Cancel forwarding,
shared breaker state and rolling restarts live in :mod:`scry.peering`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scry import systemd
from scry.config import Config, PoolConfig, PoolOverride
from scry.log import connections_logger, disconnections_logger, event, logger, setup_logging

__all__ = [
    "INSTANCE_KEY_ENV",
    "MAX_WORKERS",
    "Supervisor",
    "WorkerCommand",
    "WorkerIdentity",
    "join_instance",
    "resolve_workers",
    "run_supervisor",
    "run_worker",
    "share",
    "worker_arguments",
    "worker_config",
]

#: Worker ids are 6 bits of the cancel key (see scry.peering).
MAX_WORKERS = 64
#: The budgets divided across workers (a connection limit of 0, none, stays 0).
_LIMITS = ("max_db_connections", "max_user_connections", "max_db_client_connections",
           "max_user_client_connections")  # fmt: skip
DIVIDED = ("size", "min_size", "reserve_size", "max_client_conn", *_LIMITS)

# Restart backoff: 0.1 s doubling to 10 s; a worker that ran this long resets it.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 10.0
BACKOFF_RESET_AFTER = 30.0

#: How the supervisor hands its workers the instance's anonymization key when
#: the config has none: one random key per instance, so that the workers' hashed
#: literals and hot-value digests agree and merge (not a config setting).
INSTANCE_KEY_ENV = "_SCRY_INSTANCE_ANONYMIZE_KEY"


# --------------------------------------------------------------------------- #
# Identity and budgets (pure)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this process is within its instance (and the instance among peers)."""

    worker_id: int = 0
    workers: int = 1
    #: The supervisor's pid (the process's own pid when there is no supervisor).
    instance: int = 0
    #: Take over the listening sockets of the instance already on this port.
    replace: bool = False
    #: The instance's random anonymization key, used when the config sets none.
    instance_key: str | None = field(default=None, repr=False)
    #: Started again by the supervisor (the one before died).
    restarted: bool = False

    def share_of(self, config: Config) -> Config:
        """``config`` with this worker's share of every fleet budget."""
        return worker_config(config, self.workers, self.worker_id, self.instance_key)


def share(total: int, workers: int, worker_id: int) -> int:
    """This worker's part of a fleet budget of ``total``.

    Floor division, the remainder going one each to the lowest worker ids, so
    the shares always add up to exactly ``total``: 10 over 4 workers is
    3, 3, 2, 2. With ``total < workers`` the highest ids get 0 (see
    :func:`resolve_workers` for why that never happens to ``pool.size``).
    """
    if not 0 <= worker_id < workers:
        raise ValueError(f"worker id {worker_id} out of range for {workers} workers")
    base, extra = divmod(total, workers)
    return base + (1 if worker_id < extra else 0)


def _divide(values: dict[str, Any], workers: int, worker_id: int) -> dict[str, Any]:
    return {
        key: share(value, workers, worker_id)
        for key in DIVIDED
        if (value := values.get(key)) is not None
    }


def worker_config(
    config: Config, workers: int, worker_id: int, instance_key: str | None = None
) -> Config:
    """The config one worker runs with: every divided budget replaced by its share.

    Only worker 0 serves the admin API (the others would fight for its port;
    it answers for all of them, see scry.adminapi.instance). Without an
    ``observability.anonymize_key`` the workers use ``instance_key``.
    ``workers == 1`` returns ``config`` itself.
    """
    if workers == 1:
        return config
    pool = config.pool.model_copy(update=_divide(config.pool.model_dump(), workers, worker_id))
    databases = {}
    for name, db in config.databases.items():
        if db.pool is not None:
            shares = _divide(db.pool.model_dump(), workers, worker_id)
            db = db.model_copy(update={"pool": db.pool.model_copy(update=shares)})
        databases[name] = db
    update: dict[str, Any] = {"pool": pool, "databases": databases}
    observability = config.observability
    if instance_key and not observability.anonymize_key:
        update["observability"] = observability.model_copy(update={"anonymize_key": instance_key})
    if worker_id != 0 and config.admin.enabled:
        update["admin"] = config.admin.model_copy(update={"enabled": False})
    return config.model_copy(update=update)


def _budgets(config: Config) -> dict[str, int]:
    """The smallest size, max_client_conn and connection limit any database runs with."""
    pools: list[PoolConfig | PoolOverride] = [config.pool]
    pools += [db.pool for db in config.databases.values() if db.pool is not None]
    sizes = [p.size for p in pools if p.size is not None]
    conns = [p.max_client_conn for p in pools if p.max_client_conn is not None]
    budgets = {"pool.size": min(sizes), "max_client_conn": min(conns)}
    for limit in _LIMITS:
        if values := [v for p in pools if (v := getattr(p, limit))]:  # (0 or None: no limit)
            budgets[f"pool.{limit}"] = min(values)
    return budgets


def resolve_workers(config: Config) -> int:
    """The number of workers to run; raises ValueError with an operator's message.

    ``auto`` is the number of usable cores, capped so that every worker gets at
    least one server connection and one client slot of every database. An
    explicit number that cannot give every worker a connection is an error:
    silently opening more than ``pool.size`` connections would break the budget.
    """
    budgets = _budgets(config)
    if config.workers == "auto":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        return max(1, min(cores, MAX_WORKERS, *budgets.values()))
    workers = int(config.workers)
    if workers > MAX_WORKERS:
        raise ValueError(f"workers: at most {MAX_WORKERS} (found {workers})")
    for name, budget in budgets.items():
        if workers > budget:
            raise ValueError(
                f"workers: {workers} workers cannot share {name} {budget}: every worker "
                f"needs at least one; lower workers or raise {name}"
            )
    if workers > 1 and config.listen_host_port[1] == 0:
        raise ValueError("workers: several workers need a fixed listen port, not port 0")
    return workers


# --------------------------------------------------------------------------- #
# A worker process
# --------------------------------------------------------------------------- #


class _WorkerField(logging.Filter):
    """Adds ``worker=N`` to every log line of a worker process."""

    def __init__(self, worker_id: int) -> None:
        super().__init__()
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "fields", None) or {}
        record.fields = {**fields, "worker": self.worker_id}
        return True


def join_instance(identity: WorkerIdentity) -> WorkerIdentity:
    """In a worker process: tag its log lines with its id, and take the
    instance's anonymization key from the supervisor."""
    if identity.workers > 1:
        tag = _WorkerField(identity.worker_id)
        # (A logger's filters do not see its children's records: each gets it.)
        for each in (logger, connections_logger, disconnections_logger):
            each.addFilter(tag)
        key = os.environ.pop(INSTANCE_KEY_ENV, None)
        if key:
            identity = replace(identity, instance_key=key)
    return identity


def run_worker(config: Config, config_path: str | None, identity: WorkerIdentity) -> int:
    """Entry point of a worker process (``scry serve --worker-id I`` from the supervisor)."""
    from scry.proxy import run_proxy

    return run_proxy(config, config_path, join_instance(identity))


# --------------------------------------------------------------------------- #
# The supervisor
# --------------------------------------------------------------------------- #


#: A worker's command line, from who it is in the instance.
WorkerCommand = Callable[[WorkerIdentity], list[str]]


def worker_arguments(identity: WorkerIdentity) -> list[str]:
    """The options telling a process started by the supervisor who it is."""
    args = ["--workers", str(identity.workers), "--worker-id", str(identity.worker_id)]
    args += ["--instance", str(identity.instance)]
    args += ["--replace"] if identity.replace else []
    return args + (["--restarted"] if identity.restarted else [])


@dataclass
class _Worker:
    worker_id: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    generation: int = 0
    crashes: int = 0  # consecutive quick deaths, for the backoff
    done: bool = False  # exited on purpose; not restarted


class Supervisor:
    """Starts, watches and signals the worker processes of one instance."""

    def __init__(
        self,
        config: Config,
        config_path: str | None,
        workers: int,
        replace: bool = False,
        *,
        command: WorkerCommand | None = None,
        stop_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    ) -> None:
        self.config = config
        self.config_path = config_path
        #: How a worker is started (scry-pgbouncer's workers run its own command line).
        self._command = command or self._serve_command
        #: Forwarded to every worker, and no worker is restarted after one
        #: (scry-pgbouncer adds SIGQUIT, PgBouncer's immediate stop).
        self.stop_signals = stop_signals
        self.workers = [_Worker(i) for i in range(workers)]
        self.replace = replace
        self.instance = os.getpid()
        # One random anonymization key per instance (see INSTANCE_KEY_ENV).
        self.instance_key = secrets.token_hex(32)
        self.stopping = 0  # stop signals received
        self.exit_code = 0
        self._stop_event = asyncio.Event()
        # Under systemd, the workers notify the supervisor, which speaks for them.
        self.notifications: systemd.WorkerNotifications | None = None

    def command(self, worker: _Worker) -> list[str]:
        # Only the first generation takes over the old instance (--replace).
        first = worker.generation == 1
        identity = WorkerIdentity(worker.worker_id, len(self.workers), self.instance,
                                  self.replace and first, restarted=not first)  # fmt: skip
        return self._command(identity)

    def _serve_command(self, identity: WorkerIdentity) -> list[str]:
        cmd = [sys.executable, "-m", "scry.cli", "serve"]
        if self.config_path is not None:
            cmd += ["-c", self.config_path]
        return cmd + worker_arguments(identity)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in self.stop_signals:
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):  # pause, resume
            loop.add_signal_handler(sig, self._forward, sig)
        if systemd.manager_present():
            self.notifications = systemd.WorkerNotifications(
                lambda: {proc.pid for proc in self._live()},
                len(self.workers),
                f"listening on {self.config.listen_addr} with {len(self.workers)} workers",
            )
            self.notifications.start(loop)
        event("supervisor starting workers", workers=len(self.workers), pid=self.instance,
              addr=self.config.listen_addr)  # fmt: skip
        watchers = [loop.create_task(self._watch(worker)) for worker in self.workers]
        await asyncio.gather(*watchers)
        if self.notifications is not None:
            self.notifications.close(loop)
        from scry.peering import remove_instance_dir

        remove_instance_dir(self.config.listen_host_port[1], self.instance)
        event("supervisor stopped", exit_code=self.exit_code)
        return self.exit_code

    async def _spawn(self, worker: _Worker) -> None:
        worker.generation += 1
        worker.started = time.monotonic()
        # Own process group: a terminal's Ctrl-C reaches only the supervisor,
        # which forwards it once (a worker seeing it twice would stop at once).
        worker.proc = await asyncio.create_subprocess_exec(
            *self.command(worker),
            stdin=asyncio.subprocess.DEVNULL,
            process_group=0,
            env={**os.environ, INSTANCE_KEY_ENV: self.instance_key, **self._notify_env()},
        )
        event("worker started", worker=worker.worker_id, pid=worker.proc.pid,
              generation=worker.generation)  # fmt: skip

    async def _watch(self, worker: _Worker) -> None:
        while not self.stopping:
            await self._spawn(worker)
            assert worker.proc is not None
            code = await worker.proc.wait()
            ran = time.monotonic() - worker.started
            if code == 0 or self.stopping:
                event("worker exited", worker=worker.worker_id, exit_code=code)
                break
            if code == 1 and worker.generation == 1 and ran < BACKOFF_RESET_AFTER:
                # Could not start at all (port taken, bad TLS files): restarting won't help.
                event("worker could not start; stopping", logging.ERROR,
                      worker=worker.worker_id, exit_code=code)  # fmt: skip
                self.exit_code = 1
                self._stop_all(signal.SIGTERM)
                break
            worker.crashes = 0 if ran >= BACKOFF_RESET_AFTER else worker.crashes + 1
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, worker.crashes - 1))
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            event("worker died; restarting", logging.ERROR, worker=worker.worker_id,
                  how=how, ran_s=round(ran, 1), restart_in_s=delay)  # fmt: skip
            await self._sleep_unless_stopping(delay)
        worker.done = True

    async def _sleep_unless_stopping(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), delay)

    def _live(self) -> list[asyncio.subprocess.Process]:
        return [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]

    def _notify_env(self) -> dict[str, str]:
        """A worker's NOTIFY_SOCKET: the supervisor's own (or none)."""
        return {} if self.notifications is None else {"NOTIFY_SOCKET": self.notifications.path}

    def _reload(self) -> None:
        if self.notifications is not None:
            self.notifications.reloading()
        self._forward(signal.SIGHUP)

    def _forward(self, sig: int) -> None:
        event("signal received: forwarding to workers", signal=signal.Signals(sig).name)
        for proc in self._live():
            proc.send_signal(sig)

    def _on_stop_signal(self, sig: int) -> None:
        systemd.notify("STOPPING=1")
        self.stopping += 1
        self._stop_event.set()
        self._forward(sig)

    def _stop_all(self, sig: int) -> None:
        self.stopping += 1
        self._stop_event.set()
        for proc in self._live():
            proc.send_signal(sig)


def run_supervisor(config: Config, config_path: str | None, workers: int, replace: bool) -> int:
    """Entry point for ``scry serve`` with more than one worker."""
    setup_logging(config.log.level, config.log.format, syslog=config.log.syslog_target())
    return asyncio.run(Supervisor(config, config_path, workers, replace).run())
