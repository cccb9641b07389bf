"""PgBouncer's ``user`` setting and ``-u`` switch, PgBouncer and scry side by side.

Started as root with ``user = postgres``, a pooler reads its configuration as
root (here a TLS key only root may read) and then runs as postgres: its
process, the files it makes (pidfile, logfile, Unix socket) and everything
after belong to postgres. Switching users needs root, which CI has.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_pgbouncer_compat import HAVE_PGBOUNCER, PGBOUNCER, REPO, Bouncer, bouncer_dir, running

from scry.devcluster import DevCluster

KINDS = ["pgbouncer", "scry"] if HAVE_PGBOUNCER else ["scry"]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def ids(pid: int) -> tuple[list[int], list[int]]:
    """(real, effective, saved, filesystem) uids and gids of a process."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return [int(n) for n in fields["Uid"].split()], [int(n) for n in fields["Gid"].split()]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with bouncer_dir() as directory:
        yield directory


@pytest.fixture
def root_only_tls(pg: DevCluster) -> Iterator[tuple[Path, Path]]:
    """The cluster's server certificate and key, in a directory only root can read."""
    assert pg.server_cert is not None and pg.server_key is not None
    directory = Path(tempfile.mkdtemp(prefix="scry-root-tls-"))
    directory.chmod(0o700)
    cert, key = directory / "server.crt", directory / "server.key"
    shutil.copyfile(pg.server_cert, cert)
    shutil.copyfile(pg.server_key, key)
    key.chmod(0o600)
    try:
        yield cert, key
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@as_root
@pytest.mark.parametrize("kind", KINDS)
def test_started_as_root_runs_as_the_user(
    kind: str, pg: DevCluster, workdir: Path, root_only_tls: tuple[Path, Path]
) -> None:
    postgres = pwd.getpwnam("postgres")
    cert, key = root_only_tls
    bouncer = Bouncer(kind, pg, workdir)
    bouncer.write_ini(
        "user = postgres\nclient_tls_sslmode = allow\n"
        f"client_tls_cert_file = {cert}\nclient_tls_key_file = {key}\n"
    )
    bouncer.start(as_root=True)
    try:
        assert bouncer.proc is not None
        uids, gids = ids(bouncer.proc.pid)
        assert uids == [postgres.pw_uid] * 4, bouncer.output()
        assert gids == [postgres.pw_gid] * 4
        made = [
            workdir / f"{kind}.pid",
            workdir / f"{kind}.log",
            workdir / f".s.PGSQL.{bouncer.port}",
        ]
        for path in made:
            assert path.stat().st_uid == postgres.pw_uid, path
        assert (workdir / f"{kind}.pid").read_text().strip() == str(bouncer.proc.pid)
        # The key was read before the switch: TLS works though postgres cannot read it.
        denied = subprocess.run(["cat", str(key)], user="postgres", capture_output=True)
        assert denied.returncode != 0 and b"Permission denied" in denied.stderr
        with psycopg.connect(
            host="127.0.0.1", port=bouncer.port, user="app", password="app_pass",
            dbname="app", sslmode="require", connect_timeout=10, autocommit=True,
        ) as conn:  # fmt: skip
            assert conn.info.pgconn.ssl_in_use
            assert conn.execute("select current_user").fetchone() == ("app",)
        # A reload runs as postgres too and keeps serving.
        bouncer.proc.send_signal(signal.SIGHUP)
        with bouncer.connect() as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        bouncer.stop()
    assert bouncer.proc.returncode == 0, bouncer.output()
    assert not (workdir / f"{kind}.pid").exists(), "the user removes its own pidfile"
    if kind == "scry":
        assert "Traceback" not in bouncer.output(), bouncer.output()
        assert "running as root" not in _log(workdir / "scry.log")


@as_root
def test_root_without_user_is_warned_once(pg: DevCluster, workdir: Path) -> None:
    """PgBouncer refuses to run as root; scry serves, and says so once."""
    with running("scry", pg, workdir) as bouncer, bouncer.connect() as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    assert _log(workdir / "scry.log").count("running as root") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_an_unknown_user_stops_the_start(kind: str, workdir: Path, pg: DevCluster) -> None:
    bouncer = Bouncer(kind, pg, workdir)
    bouncer.write_ini("user = scry_no_such_user\n")
    cmd = (
        [PGBOUNCER, str(bouncer.ini)]
        if kind == "pgbouncer"
        else [sys.executable, "-m", "scry.pgbouncer.cli", str(bouncer.ini)]
    )
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    output = result.stdout + result.stderr + _log(workdir / f"{kind}.log")
    assert "scry_no_such_user" in output, output
    if kind == "scry":
        assert "no such user" in result.stderr and "Traceback" not in output


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
