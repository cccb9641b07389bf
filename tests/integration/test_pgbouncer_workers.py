"""A pgbouncer.ini served by several workers: ``[scry] workers = 2`` for
scry-pgbouncer, ``--workers 2`` for ``scry serve --pgbouncer-config``.

The workers share the port (SO_REUSEPORT), so a client or a console session
lands on either. The ``pgbouncer`` console answers for the whole instance
wherever it lands: SHOW merges every worker's rows, commands reach every
worker, KILL_CLIENT finds the worker that owns the id. Worker 0 alone serves
the Unix socket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_pgbouncer_compat import REPO, Bouncer, bouncer_dir

from scry.devcluster import DevCluster

WORKERS = "\n[scry]\nworkers = 2\n"


def wait_workers(bouncer: Bouncer, wait_until: Callable[..., Any]) -> None:
    wait_until(
        lambda: set(re.findall(r"listening .*worker=(\d)", bouncer.output())) == {"0", "1"},
        15,
        what="both workers listening",
    )


@pytest.fixture
def instance(pg: DevCluster, wait_until: Callable[..., Any]) -> Iterator[Bouncer]:
    with bouncer_dir() as directory:
        bouncer = Bouncer("scry", pg, directory)
        bouncer.ini.write_text(bouncer.ini.read_text() + WORKERS)
        bouncer.start()
        try:
            wait_workers(bouncer, wait_until)
            yield bouncer
        finally:
            bouncer.stop()


def show(bouncer: Bouncer, what: str, **connect: Any) -> list[dict[str, Any]]:
    answer = bouncer.admin(f"SHOW {what}", **connect)
    assert answer[0] != "error", answer
    columns, rows, _status = answer
    names = [name for name, _type in columns]
    return [dict(zip(names, row, strict=True)) for row in rows]


def pool(bouncer: Bouncer, database: str = "app") -> dict[str, Any]:
    return next(r for r in show(bouncer, "POOLS") if r["database"] == database)


@contextlib.contextmanager
def app_clients(bouncer: Bouncer, count: int) -> Iterator[list[psycopg.Connection]]:
    """``count`` clients of database app, each having run a query."""
    conns = [bouncer.connect() for _ in range(count)]
    try:
        for conn in conns:
            conn.execute("select 1")
        yield conns
    finally:
        for conn in conns:
            conn.close()


def notices_of(console: psycopg.Connection) -> list[str]:
    """The NOTICEs the console sends from now on (kept as they come)."""
    notices: list[str] = []
    console.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    console.prepare_threshold = None
    return notices


def local_port(conn: psycopg.Connection) -> int:
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        port: int = sock.getsockname()[1]
        return port


def console_over_unix(bouncer: Bouncer) -> psycopg.Connection:
    return psycopg.connect(
        host=str(bouncer.dir), port=bouncer.port, user="admin", password="admin_pass",
        dbname="pgbouncer", autocommit=True,
    )  # fmt: skip


def test_show_counts_every_workers_clients(instance: Bouncer) -> None:
    with app_clients(instance, 16) as conns:
        clients = [r for r in show(instance, "CLIENTS") if r["database"] == "app"]
        assert len(clients) == 16
        # Both workers have some (all 16 on one: odds of 2 in 65536).
        assert {r["ptr"].split(".")[0] for r in clients} == {"w0", "w1"}
        assert sorted(r["port"] for r in clients) == sorted(map(local_port, conns))
        # The log says which worker a connection event is about (ids repeat across workers).
        assert {"0", "1"} <= set(re.findall(r"client login .*worker=(\d)", instance.output()))
        every = show(instance, "SOCKETS")
        # Ids are instance-wide (clients and servers are numbered apart, as before).
        assert len({(r["type"], r["id"]) for r in every}) == len(every)

        assert pool(instance)["cl_active"] == 16
        databases = {r["name"]: r for r in show(instance, "DATABASES")}
        assert databases["app"]["pool_size"] == 4  # default_pool_size: 2 + 2
        assert databases["app"]["current_client_connections"] == 16
        assert databases["pgbouncer"]["pool_size"] == 2  # the console's row is no budget
        assert databases["forced"]["paused"] == 0  # (no pool yet: 0, not NULL)
        stats = next(r for r in show(instance, "STATS") if r["database"] == "app")
        assert stats["total_query_count"] >= 16
        lists = {r["list"]: r["items"] for r in show(instance, "LISTS")}
        assert lists["used_clients"] == 17  # and this console session
        assert lists["databases"] == 4  # app, forced, spread, pgbouncer: not twice

        # Worker 0 alone serves the Unix socket.
        with console_over_unix(instance) as console:
            console.prepare_threshold = None
            cur = console.execute("SHOW CLIENTS", prepare=False)
            names = [c.name for c in cur.description or []]
            sessions = [r for r in cur.fetchall() if r[names.index("database")] == "pgbouncer"]
            assert [r[names.index("ptr")][:4] for r in sessions] == ["w0.a"]


def worker_of(conn: psycopg.Connection) -> int:
    """The worker serving a client: its BackendKeyData pid says (scry.peering)."""
    return (conn.info.backend_pid >> 11) & 63


def test_show_fingerprints_takes_p99_from_every_workers_histogram(
    instance: Bouncer, wait_until: Callable[..., Any]
) -> None:
    """One slow call on worker 0 and 150 fast ones of the same statement on
    worker 1: the instance's p99 is a fast call. Worker 0's own p99, which
    the largest-worker merge reported, is the slow one."""
    conns: list[psycopg.Connection] = []
    try:
        by_worker: dict[int, psycopg.Connection] = {}
        while len(by_worker) < 2 and len(conns) < 40:  # (40 all on one: 2 in 10^12)
            conns.append(instance.connect())
            by_worker.setdefault(worker_of(conns[-1]), conns[-1])
        by_worker[0].execute("select pg_sleep(0.05)", prepare=False)
        for _ in range(150):
            by_worker[1].execute("select pg_sleep(0)", prepare=False)
    finally:
        for conn in conns:
            conn.close()

    def sleeps() -> dict[str, Any] | None:
        rows = [r for r in show(instance, "FINGERPRINTS") if "pg_sleep" in r["query"]]
        return rows[0] if rows and rows[0]["calls"] == 151 else None

    row = wait_until(sleeps, 10, what="both workers' calls counted")
    assert float(row["p99_ms"]) < 25
    assert 50 / 151 <= float(row["mean_ms"]) < 25


def test_kill_client_reaches_the_worker_that_owns_it(instance: Bouncer) -> None:
    with app_clients(instance, 12) as conns:
        by_port = {local_port(conn): conn for conn in conns}
        clients = [r for r in show(instance, "CLIENTS") if r["database"] == "app"]
        victims = {}
        for row in clients:  # one client of each worker
            victims.setdefault(row["ptr"].split(".")[0], row)
        assert set(victims) == {"w0", "w1"}
        for row in victims.values():
            assert instance.admin(f"KILL_CLIENT {row['id']}")[2] == "KILL_CLIENT"
        killed = {by_port[row["port"]] for row in victims.values()}
        for conn in conns:
            if conn in killed:
                with pytest.raises(psycopg.OperationalError):
                    conn.execute("select 1")
            else:
                assert conn.execute("select 1").fetchone() == (1,)
        assert len([r for r in show(instance, "CLIENTS") if r["database"] == "app"]) == 10
        assert instance.admin("KILL_CLIENT 999999")[1:] == ("08P01", "client not found")


def test_pause_and_resume_reach_every_worker(
    instance: Bouncer, wait_until: Callable[..., Any]
) -> None:
    with app_clients(instance, 12) as conns:
        assert instance.admin("PAUSE")[2] == "PAUSE"
        assert dict((r["key"], r["value"]) for r in show(instance, "STATE"))["paused"] == "yes"
        with concurrent.futures.ThreadPoolExecutor(len(conns)) as pool_:
            queries = [pool_.submit(conn.execute, "select 1") for conn in conns]
            wait_until(lambda: pool(instance)["cl_waiting"] == 12, 10, what="12 clients waiting")
            waiting = [r for r in show(instance, "CLIENTS") if r["state"] == "waiting"]
            assert {r["ptr"].split(".")[0] for r in waiting} == {"w0", "w1"}
            assert not any(q.done() for q in queries)
            assert instance.admin("RESUME")[2] == "RESUME"
            for query in queries:
                assert query.result(10).fetchone() == (1,)
        # Every worker agrees it is no longer paused.
        assert instance.admin("RESUME")[1:] == ("08P01", "pooler is not paused/suspended")


def test_a_restarted_worker_takes_the_instance_state(
    instance: Bouncer, wait_until: Callable[..., Any]
) -> None:
    """A worker started again after a crash is paused, disabled and SET as
    the console left the others, not as the ini says."""
    with console_over_unix(instance) as console:  # (worker 0's: it stays)
        notices = notices_of(console)
        for sql in ("SET default_pool_size = 6", "DISABLE forced", "PAUSE"):
            console.execute(sql, prepare=False)
        os.kill(worker_pid(instance, 1), signal.SIGKILL)
        wait_until(
            lambda: len(re.findall(r"listening .*worker=1", instance.output())) == 2,
            15,
            what="worker 1 started again",
        )
        # It took the state before it shared the port again: no client of
        # its came in while it was in the ini's state.
        restarted = instance.output().split("\n")
        took = next(i for i, line in enumerate(restarted) if "took the console's state" in line)
        listening = [
            i for i, line in enumerate(restarted) if re.search("listening .*worker=1", line)
        ]
        assert listening[0] < took < listening[1]
        assert pool_size(instance) == 6  # 3 + 3, not 3 + 2 from the ini
        for _ in range(8):  # (on either worker)
            with pytest.raises(psycopg.OperationalError, match="does not allow connections"):
                instance.connect(dbname="forced")
        assert console.execute("RESUME", prepare=False).statusmessage == "RESUME"
        assert notices == []  # both were paused
    with instance.connect() as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_a_command_refused_by_some_workers_says_so(
    instance: Bouncer, wait_until: Callable[..., Any]
) -> None:
    os.kill(worker_pid(instance, 1), signal.SIGUSR1)  # PAUSE, on worker 1 alone
    wait_until(lambda: re.search(r"\bpaused database=\* worker=1", instance.output()), 10)
    with console_over_unix(instance) as console:  # (worker 0's)
        notices = notices_of(console)
        assert console.execute("RESUME", prepare=False).statusmessage == "RESUME"
        assert notices == ["worker 0: pooler is not paused/suspended"]
    with pytest.raises(psycopg.errors.ProtocolViolation, match="not paused"):
        console_over_unix(instance).execute("RESUME")  # (now nobody is)
    with instance.connect() as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def worker_pid(bouncer: Bouncer, worker: int) -> int:
    assert bouncer.proc is not None
    marker = f"--worker-id\x00{worker}\x00"
    return next(pid for pid in children(bouncer.proc.pid) if marker in cmdline(pid))


def test_a_stopped_worker_is_left_out_with_a_notice(instance: Bouncer) -> None:
    worker_1 = worker_pid(instance, 1)
    os.kill(worker_1, signal.SIGSTOP)
    try:
        with console_over_unix(instance) as console:  # (worker 0's)
            notices = notices_of(console)
            started = time.monotonic()
            rows = console.execute("SHOW POOLS", prepare=False).fetchall()
            assert time.monotonic() - started < 5
            assert rows
            assert notices == ["worker 1 did not answer (timeout (1 s)); left out"]
    finally:
        os.kill(worker_1, signal.SIGCONT)


COMMANDS = [
    ("RECONNECT", "RECONNECT"), ("RECONNECT app", "RECONNECT"), ("WAIT_CLOSE", "WAIT_CLOSE"),
    ("KILL app", "KILL"), ("RESUME app", "RESUME"), ("DISABLE app", "DISABLE"),
    ("ENABLE app", "ENABLE"), ("SUSPEND", "SUSPEND"), ("RESUME", "RESUME"),
    ("SET default_pool_size = 6", "SET default_pool_size=6"), ("RELOAD", "RELOAD"),
    ("SET client_encoding = 'UTF8'", "SET"), ("SHOW HELP", "SHOW"),
]  # fmt: skip


def test_every_command_answers_for_the_instance(instance: Bouncer) -> None:
    with app_clients(instance, 6):
        for sql, status in COMMANDS:
            assert instance.admin(sql)[2] == status, sql
        assert pool_size(instance) == 6  # the SET, on both workers (3 + 3)
        assert instance.admin("PAUSE nosuchdb")[1:] == ("08P01", "no such database: nosuchdb")
        assert instance.output().count('error="no such database: nosuchdb"') == 1  # logged once
        stats = {"user": "stats", "password": "stats_pass"}
        assert show(instance, "POOLS", **stats)
        assert instance.admin("PAUSE", **stats)[1:] == ("08P01", "admin access needed")
        # It answers, though the worker it ran on may have no client to wait for.
        assert instance.admin("SHUTDOWN WAIT_FOR_CLIENTS")[2] == "SHUTDOWN"
    assert instance.proc is not None
    assert instance.proc.wait(15) == 0  # once the clients left


def test_shutdown_stops_the_instance(instance: Bouncer) -> None:
    with instance.connect("admin", "admin_pass", "pgbouncer") as console:
        console.prepare_threshold = None
        with pytest.raises(psycopg.OperationalError):
            console.execute("SHUTDOWN", prepare=False)
    assert instance.proc is not None
    assert instance.proc.wait(15) == 0
    assert not (instance.dir / f".s.PGSQL.{instance.port}").exists()
    log = instance.output()
    assert "worker exited worker=0 exit_code=0" in log
    assert "worker exited worker=1 exit_code=0" in log


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_workers_that_switched_user_still_answer_the_console(
    pg: DevCluster, wait_until: Callable[..., Any]
) -> None:
    """Started as root with ``user = postgres``: each worker switches after
    loading what the console uses (the interpreter's own files may be out of
    postgres's reach, as this machine's are)."""
    with bouncer_dir() as directory:
        bouncer = Bouncer("scry", pg, directory)
        bouncer.write_ini("user = postgres\n")
        bouncer.ini.write_text(bouncer.ini.read_text() + WORKERS)
        bouncer.start()
        try:
            wait_workers(bouncer, wait_until)
            postgres = pwd.getpwnam("postgres").pw_uid
            assert bouncer.proc is not None
            for worker in (0, 1):
                status = Path(f"/proc/{worker_pid(bouncer, worker)}/status").read_text()
                assert f"Uid:\t{postgres}\t" in status
            with app_clients(bouncer, 4):
                for _ in range(6):  # (sessions on either worker)
                    assert pool(bouncer)["cl_active"] == 4
            assert "console command failed" not in bouncer.output()
        finally:
            bouncer.stop()


def test_replace_hands_the_port_to_a_new_instance(
    instance: Bouncer, wait_until: Callable[..., Any]
) -> None:
    """``--replace``: a new instance of two workers takes the listening
    sockets over; the old one serves its clients until they leave, then exits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    log = instance.dir / "new.out"
    with open(log, "ab") as out, app_clients(instance, 4) as old:
        new_instance = subprocess.Popen(
            [sys.executable, "-m", "scry.pgbouncer.cli", "--replace", str(instance.ini)],
            cwd=REPO, env={**env, "SCRY_ADMIN__ENABLED": "false"}, stdout=out, stderr=out,
        )  # fmt: skip
        try:
            wait_until(
                lambda: set(re.findall(r"listening .*worker=(\d)", log.read_text())) == {"0", "1"},
                15,
                what="the new instance's workers listening",
            )
            with app_clients(instance, 4):
                for conn in old:
                    assert conn.execute("select 1").fetchone() == (1,)
                # The console is the new instance's: only the new clients.
                assert len([r for r in show(instance, "CLIENTS") if r["database"] == "app"]) == 4
                assert instance.proc is not None and instance.proc.poll() is None
            for conn in old:
                conn.close()
            assert instance.proc.wait(15) == 0  # once its clients left
            assert (instance.dir / f".s.PGSQL.{instance.port}").exists()  # (the new one's now)
        finally:
            new_instance.send_signal(signal.SIGINT)
            assert new_instance.wait(15) == 0


def test_scry_serve_workers_and_sighup(pg: DevCluster, wait_until: Callable[..., Any]) -> None:
    """``scry serve --pgbouncer-config --workers 2``; a SIGHUP to the
    supervisor re-reads the ini in every worker."""
    with bouncer_dir() as directory, contextlib.ExitStack() as stack:
        bouncer = Bouncer("scry", pg, directory)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
        out = stack.enter_context(open(directory / "scry.out", "ab"))  # noqa: SIM115
        bouncer._out = out
        cmd = [sys.executable, "-m", "scry.cli", "serve", "--pgbouncer-config", str(bouncer.ini),
               "--workers", "2"]  # fmt: skip
        bouncer.proc = subprocess.Popen(
            cmd, cwd=REPO, env={**env, "SCRY_ADMIN__ENABLED": "false"}, stdout=out, stderr=out
        )
        stack.callback(bouncer.stop)
        wait_workers(bouncer, wait_until)
        assert pool_size(bouncer) == 4
        bouncer.ini.write_text(
            bouncer.ini.read_text().replace("default_pool_size = 4", "default_pool_size = 8")
        )
        bouncer.proc.send_signal(signal.SIGHUP)
        # 4 + 4; a worker that missed the SIGHUP would leave it at 6.
        wait_until(lambda: pool_size(bouncer) == 8, 10, what="pool_size 8 on both workers")


def pool_size(bouncer: Bouncer) -> int:
    size: int = next(r for r in show(bouncer, "DATABASES") if r["name"] == "app")["pool_size"]
    return size


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text()
