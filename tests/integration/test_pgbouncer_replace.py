"""scry-pgbouncer --replace: a rolling restart from a pgbouncer.ini.

The new process takes the listening sockets over, TCP and Unix (so no
connection is refused); the old one keeps its clients until they leave, then
exits without removing the pidfile or the Unix socket it handed over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from test_pgbouncer_compat import REPO, Bouncer, bouncer_dir
from test_workers_rolling import assert_clean_run

from scry.devcluster import DevCluster, find_pg_bindir


def test_replace_takes_over_and_the_old_process_leaves_with_its_last_client(
    pg: DevCluster, wait_until
) -> None:
    with bouncer_dir() as directory:
        old, new = _running_and_next(pg, directory)
        unix_socket = directory / f".s.PGSQL.{old.port}"
        try:
            held = old.connect()
            held.execute("begin")
            held.execute("select 1")
            listening = _listening_unix_socket(unix_socket)
            new.start("--replace")
            wait_until(lambda: "took over listening sockets" in old.output(), 15, what="takeover")
            assert old.proc is not None and new.proc is not None
            assert old.proc.poll() is None  # the old one stays for its client
            assert held.execute("select 2").fetchone() == (2,)
            held.execute("commit")
            held.close()
            assert old.proc.wait(15) == 0
            with new.connect() as conn:  # TCP
                assert conn.execute("select 3").fetchone() == (3,)
            with psycopg.connect(
                host=str(directory), port=new.port, user="app", password="app_pass",
                dbname="app", connect_timeout=10,
            ) as conn:  # fmt: skip
                assert conn.execute("select 4").fetchone() == (4,)
            # The same listening socket, handed over: not a new one bound at
            # that path (whose accept queue would have lost what waited).
            assert _listening_unix_socket(unix_socket) == listening
            pidfile = directory / "scry.pid"
            assert pidfile.read_text().strip() == str(new.proc.pid)
        finally:
            new.stop()
            old.stop()
        assert not (directory / f".s.PGSQL.{new.port}").exists()  # the new one removed its own
        assert "Traceback" not in new.output()


def test_replace_keeps_the_consoles_pause_and_disable_but_not_set(
    pg: DevCluster, wait_until
) -> None:
    """As PgBouncer's online restart would not lose them: the new process is
    paused and the database disabled as the console left the old one; a SET
    is not carried over (the new ini says what it says)."""
    with bouncer_dir() as directory:
        old, new = _running_and_next(pg, directory)
        try:
            assert old.admin("SET default_pool_size = 3")[2].startswith("SET")
            assert old.admin("DISABLE app")[2] == "DISABLE"
            assert old.admin("PAUSE")[2] == "PAUSE"
            new.start("--replace")
            assert old.proc is not None and old.proc.wait(15) == 0  # (no clients)
            assert dict(new.admin("SHOW STATE")[1])["paused"] == "yes"
            assert (
                dict((r[0], r[1]) for r in new.admin("SHOW CONFIG")[1])["default_pool_size"] == "4"
            )
            with pytest.raises(psycopg.OperationalError, match="does not allow connections"):
                new.connect().close()
            assert new.admin("RESUME")[2] == "RESUME"
            assert new.admin("ENABLE app")[2] == "ENABLE"
            with new.connect() as conn:
                assert conn.execute("select 1").fetchone() == (1,)
        finally:
            for bouncer in (new, old):
                if bouncer.proc is not None:
                    bouncer.stop()
        assert "took the replaced instance's console state" in new.output()


def _running_and_next(pg: DevCluster, directory: Path) -> tuple[Bouncer, Bouncer]:
    """A scry-pgbouncer started, and the one to replace it (not started yet)
    with the same ini: same port, pidfile and socket."""
    old = Bouncer("scry", pg, directory)
    old.start()
    new = Bouncer("scry", pg, directory)
    new.port = old.port
    new.write_ini()
    return old, new


def _listening_unix_socket(path: Path) -> str:
    """The kernel's inode number of the socket listening at ``path`` (the
    file's own inode number may be reused at once by a new bind)."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode Path; __SO_ACCEPTCON is 0x10000
        if len(fields) == 8 and fields[7] == str(path) and int(fields[3], 16) & 0x10000:
            return fields[6]
    raise AssertionError(f"nothing listens at {path}")


def test_scry_serve_pgbouncer_config_replace(pg: DevCluster) -> None:
    """``scry serve --pgbouncer-config INI --replace`` takes over from a
    scry-pgbouncer on that ini; the old one, with no client, exits at once."""
    with bouncer_dir() as directory:
        old = Bouncer("scry", pg, directory)
        old.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
        env["SCRY_ADMIN__ENABLED"] = "false"
        cmd = [sys.executable, "-m", "scry.cli", "serve", "--pgbouncer-config", str(old.ini)]
        with open(directory / "serve.out", "wb") as out:
            new = subprocess.Popen([*cmd, "--replace"], cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            assert old.proc is not None and old.proc.wait(15) == 0
            with old.connect() as conn:  # (the same port: the new process now)
                assert conn.execute("select 1").fetchone() == (1,)
            assert new.poll() is None
        finally:
            new.send_signal(signal.SIGINT)
            new.wait(10)
            old.stop()
        assert "took over listening sockets" in (directory / "serve.out").read_text()


def test_replace_whose_ini_drops_the_unix_socket_removes_it(pg: DevCluster) -> None:
    """The old process handed its Unix socket over and leaves its file be; a
    replacement whose ini no longer has ``unix_socket_dir`` closes the socket
    and removes the file, so no stale socket is left behind."""
    with bouncer_dir() as directory:
        old = Bouncer("scry", pg, directory)
        old.start()
        unix_socket = directory / f".s.PGSQL.{old.port}"
        assert unix_socket.exists()
        new = Bouncer("scry", pg, directory)
        new.port = old.port
        new.write_ini()
        new.ini.write_text(
            new.ini.read_text().replace(f"unix_socket_dir = {directory}\n", "unix_socket_dir =\n")
        )
        try:
            new.start("--replace")
            assert old.proc is not None and old.proc.wait(15) == 0
            assert not unix_socket.exists()
            with new.connect() as conn:  # TCP, taken over
                assert conn.execute("select 1").fetchone() == (1,)
        finally:
            new.stop()
            old.stop()
        assert "Traceback" not in new.output() + old.output()


@pytest.mark.slow
def test_replace_under_pgbench_over_the_unix_socket(
    pg: DevCluster, wait_until, tmp_path: Path
) -> None:
    """pgbench making a new connection for every transaction over the Unix
    socket, across a takeover: none fails. (Binding a new socket in place of
    the old one reset what waited in the old one's accept queue, and refused
    connections while nothing listened at the path.)"""
    script = tmp_path / "select1.sql"
    script.write_text("select 1;\n")
    with bouncer_dir() as directory:
        old, new = _running_and_next(pg, directory)
        cmd = [
            str(find_pg_bindir() / "pgbench"), "-n", "-M", "simple", "-f", str(script),
            "-h", str(directory), "-p", str(old.port), "-U", "app",
            "-C", "-c", "4", "-j", "1", "-T", "14", "app",
        ]  # fmt: skip
        env = {**os.environ, "PGPASSWORD": "app_pass"}
        bench = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_until(lambda: "client login" in old.output(), 15, what="pgbench logging in")
            new.start("--replace")
            wait_until(lambda: "took over listening sockets" in old.output(), 15, what="takeover")
            assert bench.poll() is None, "the takeover came after the load; nothing was tested"
            assert_clean_run(bench)
            assert old.proc is not None and old.proc.wait(15) == 0
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
            new.stop()
            old.stop()
