"""Fixtures for the integration tests: a real ``scry serve`` subprocess.

``scry_proxy(overrides)`` writes a YAML config into the test's ``tmp_path``
(a base config pointing at the session ``pg`` cluster, deep-merged with
``overrides``), starts ``python -m scry.cli serve -c <yaml>`` with stderr
captured to a file, and waits until the port accepts TCP connections. At
teardown the proxy gets SIGTERM (then SIGKILL after a bound) and its log must
not contain a Python traceback: a traceback is always a bug.

``backend_count(pg, ...)`` counts the PostgreSQL backends the proxy opened
(``usename = 'app'`` on database ``app``); the tests' own direct connections
use the ``postgres`` superuser and so are never counted.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from scry.devcluster import DevCluster, free_port

READY_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
REPO = Path(__file__).resolve().parents[2]


def deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``overrides``; nested dicts merge, ``None`` deletes a key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class ScryProcess:
    """A running ``scry serve`` subprocess."""

    def __init__(self, pg: DevCluster, directory: Path, config: dict[str, Any]) -> None:
        self.pg = pg
        self.dir = directory
        self.config = config
        self.port = int(str(config["listen_addr"]).rpartition(":")[2])
        self.config_path = directory / "scry.yaml"
        self.log_path = directory / "scry.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_wall = 0.0  # time.time() just before the start (filters pg_stat_activity)
        self.write_config(config)

    # --- config ---------------------------------------------------------------------

    def write_config(self, config: dict[str, Any]) -> None:
        self.config = config
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.replace(self.config_path)

    def update_config(self, overrides: Mapping[str, Any]) -> None:
        """Deep-merge ``overrides`` into the config file (apply with SIGHUP)."""
        self.write_config(deep_merge(self.config, overrides))

    # --- process --------------------------------------------------------------------

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", "scry.cli", "serve", "-c", str(self.config_path)]
        self.started_wall = time.time() - 0.5  # generous: backend_start is the server's clock
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(
                    f"scry exited with {self.proc.returncode} before listening\n{self.log_tail()}",
                    pytrace=False,
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"scry did not listen on port {self.port} within {READY_TIMEOUT}s\n"
                    f"{self.log_tail()}",
                    pytrace=False,
                )
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; raises subprocess.TimeoutExpired."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    # --- logs and connection strings --------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- tail of {self.log_path} ---\n{tail}"

    def dsn(
        self, user: str = "app", password: str | None = "app_pass", dbname: str = "app", **params
    ) -> str:
        """A postgresql:// URL to the proxy (``params`` become query parameters;
        None leaves one out)."""
        params.setdefault("sslmode", "disable")
        params.setdefault("connect_timeout", "10")
        params = {k: v for k, v in params.items() if v is not None}
        return self.pg.dsn(
            user=user,
            password=password,
            dbname=dbname,
            host="127.0.0.1",
            port=self.port,
            **params,
        )

    def asyncpg_dsn(self, user: str = "app", password: str | None = "app_pass", **params) -> str:
        """``dsn`` for asyncpg, which sends query parameters it does not know
        (``connect_timeout``) as settings: pass ``timeout=`` to it instead."""
        return self.dsn(user, password, connect_timeout=None, **params)

    def conninfo(self, user: str = "app", password: str | None = "app_pass", dbname: str = "app"):
        """Keyword arguments for psycopg.connect / AsyncConnection.connect."""
        kw: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": user,
            "dbname": dbname,
            "sslmode": "disable",
            "connect_timeout": 10,
        }
        if password is not None:
            kw["password"] = password
        return kw


def base_config(pg: DevCluster, port: int) -> dict[str, Any]:
    return {
        "listen_addr": f"127.0.0.1:{port}",
        "database_url": pg.url(),
        "pool": {"mode": "transaction", "size": 5},
        "timeouts": {
            "query_wait_timeout": 10,
            "server_connect_timeout": 5,
            "client_login_timeout": 10,
        },
        "admin": {"enabled": False},
        "log": {"level": "info"},
    }


@pytest.fixture
def scry_proxy(pg: DevCluster, tmp_path: Path) -> Iterator[Callable[..., ScryProcess]]:
    """Factory: ``scry_proxy({"pool": {"size": 1}})`` -> a running :class:`ScryProcess`."""
    started: list[ScryProcess] = []

    def make(overrides: Mapping[str, Any] | None = None, *, start: bool = True) -> ScryProcess:
        directory = tmp_path / f"scry{len(started)}"
        directory.mkdir()
        config = deep_merge(base_config(pg, free_port()), overrides or {})
        proxy = ScryProcess(pg, directory, config)
        started.append(proxy)
        if start:
            proxy.start()
        return proxy

    yield make

    problems = []
    for proxy in started:
        proxy.stop()
        text = proxy.log_text()
        if "Traceback" in text:
            problems.append(f"scry logged a Python traceback:\n{proxy.log_tail(80)}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


# --- PostgreSQL-side observation ---------------------------------------------------------


def admin_conninfo(pg: DevCluster, dbname: str = "app") -> str:
    """A direct superuser connection string (never counted as a proxy backend)."""
    return pg.dsn(user="postgres", dbname=dbname, sslmode="disable")


BACKEND_COUNT_SQL = """
select count(*) from pg_stat_activity
where datname = 'app' and usename = %(user)s and backend_type = 'client backend'
  and pid <> pg_backend_pid()
  and (%(app)s::text is null or application_name = %(app)s::text)
  and (%(since)s::float8 is null or backend_start >= to_timestamp(%(since)s::float8))
"""


def backend_count(
    pg: DevCluster,
    application: str | None = None,
    *,
    proxy: ScryProcess | None = None,
    user: str = "app",
) -> int:
    """Backends of ``user`` (default ``app``, the proxy's forced user) on database ``app``.

    ``proxy`` restricts the count to backends started after that proxy was
    launched, so leftovers of an earlier test's proxy are never counted.
    """
    since = proxy.started_wall if proxy is not None else None
    with psycopg.connect(admin_conninfo(pg), autocommit=True) as conn:
        row = conn.execute(
            BACKEND_COUNT_SQL, {"user": user, "app": application, "since": since}
        ).fetchone()
    assert row is not None
    return int(row[0])


def backend_pids(pg: DevCluster, query_like: str) -> list[int]:
    """PIDs of backends (other than ours) whose current/last query matches ``query_like``."""
    with psycopg.connect(admin_conninfo(pg), autocommit=True) as conn:
        rows = conn.execute(
            "select pid from pg_stat_activity where query like %s and pid <> pg_backend_pid()",
            (query_like,),
        ).fetchall()
    return [int(r[0]) for r in rows]


def assert_no_traceback(proxy: ScryProcess) -> None:
    text = proxy.log_text()
    assert "Traceback" not in text, proxy.log_tail(80)


# Test modules cannot import from a conftest reliably (several conftest.py
# files share that module name), so the helpers are also handed out as fixtures.


@pytest.fixture(name="backend_count")
def _backend_count_fixture() -> Callable[..., int]:
    """``backend_count(pg, application=None, *, proxy=None, user="app")``."""
    return backend_count


@pytest.fixture(name="backend_pids")
def _backend_pids_fixture() -> Callable[..., list[int]]:
    return backend_pids


@pytest.fixture(name="wait_until")
def _wait_until_fixture() -> Callable[..., Any]:
    """``wait_until(predicate, timeout, interval=0.02, what="")``."""
    return wait_until


@pytest.fixture(name="admin_dsn")
def _admin_dsn_fixture(pg: DevCluster) -> str:
    """A direct superuser DSN to database app (for pg_stat_activity sampling)."""
    return admin_conninfo(pg)


# --- added for the hybrid / prepared / observe / breaker suites ---------------------------


@pytest.fixture(scope="module")
def scry_proxy_module(
    pg: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ScryProcess]]:
    """Module-scoped twin of ``scry_proxy``: proxies shared by a module's tests.

    ``scry_proxy_module(overrides, cluster=other_devcluster)`` points the base
    config at ``cluster`` instead of the session ``pg``.
    """
    started: list[ScryProcess] = []
    base = tmp_path_factory.mktemp("scrymod")

    def make(
        overrides: Mapping[str, Any] | None = None,
        *,
        start: bool = True,
        cluster: DevCluster | None = None,
    ) -> ScryProcess:
        target = cluster if cluster is not None else pg
        directory = base / f"scry{len(started)}"
        directory.mkdir()
        config = deep_merge(base_config(target, free_port()), overrides or {})
        proxy = ScryProcess(target, directory, config)
        started.append(proxy)
        if start:
            proxy.start()
        return proxy

    yield make

    problems = []
    for proxy in started:
        proxy.stop()
        if "Traceback" in proxy.log_text():
            problems.append(f"scry logged a Python traceback:\n{proxy.log_tail(80)}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
