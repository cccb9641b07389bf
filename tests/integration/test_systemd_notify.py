"""systemd's notifications (``Type=notify``, as in Debian's pgbouncer.service):
READY=1 once listening, RELOADING=1 and READY=1 around a SIGHUP reload,
STOPPING=1 when a stop signal arrives; with workers, the supervisor speaks
for them once all are ready. The test plays systemd: a Unix
datagram socket named by NOTIFY_SOCKET in the proxy's environment.
PgBouncer 1.18 (built with systemd) says READY=1 too.
"""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_pgbouncer_compat import HAVE_PGBOUNCER, Bouncer, bouncer_dir
from test_socket_sizes import listen_backlog

from scry.devcluster import DevCluster


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """The service manager's end: what the proxy sends arrives here."""
    directory = Path(tempfile.mkdtemp(prefix="scry-notify-"))  # (a short socket path)
    path = directory / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        directory.chmod(0o755)  # (PgBouncer, run as postgres under root, sends too)
        path.chmod(0o777)
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        try:
            yield sock
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def received(manager: socket.socket) -> dict[str, str]:
    fields = manager.recv(4096).decode().split("\n")
    return dict(field.split("=", 1) for field in fields)


def test_scry_serve_tells_systemd_it_is_ready_reloading_and_stopping(
    scry_proxy, manager: socket.socket
) -> None:
    proxy = scry_proxy()
    ready = received(manager)
    assert ready["READY"] == "1" and ready["STATUS"].startswith("listening on 127.0.0.1:")
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    proxy.send_signal(signal.SIGHUP)
    reloading = received(manager)
    assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
    assert received(manager) == {"READY": "1"}
    proxy.send_signal(signal.SIGTERM)
    assert received(manager) == {"STOPPING": "1"}


@pytest.mark.parametrize("kind", ["pgbouncer", "scry"] if HAVE_PGBOUNCER else ["scry"])
def test_a_pgbouncer_ini_service_is_ready_when_it_listens(
    kind: str, pg: DevCluster, manager: socket.socket
) -> None:
    with bouncer_dir() as directory:
        bouncer = Bouncer(kind, pg, directory)
        bouncer.start()
        try:
            assert received(manager)["READY"] == "1"
            with bouncer.connect() as conn:
                assert conn.execute("select 1").fetchone() == (1,)
            if kind == "scry":  # (PgBouncer 1.24 added reload notifications)
                assert bouncer.proc is not None
                bouncer.proc.send_signal(signal.SIGHUP)
                assert received(manager)["RELOADING"] == "1"
                assert received(manager) == {"READY": "1"}
        finally:
            bouncer.stop()
        assert received(manager)["STOPPING"] == "1"


def children(pid: int) -> list[int]:
    return [int(n) for n in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_supervisor_is_ready_when_all_its_workers_are(scry_proxy, manager: socket.socket) -> None:
    proxy = scry_proxy({"workers": 2})
    ready = received(manager)
    assert ready["READY"] == "1" and ready["STATUS"].endswith("with 2 workers"), ready
    workers = children(proxy.pid)
    assert len(workers) == 2
    for worker in workers:  # both listen by then
        assert listen_backlog(worker, proxy.port) > 0
    proxy.send_signal(signal.SIGHUP)
    assert received(manager)["RELOADING"] == "1"
    assert received(manager)["READY"] == "1"
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    proxy.send_signal(signal.SIGTERM)
    assert received(manager) == {"STOPPING": "1"}
    manager.settimeout(1)
    with pytest.raises(TimeoutError):  # the workers' own notifications stay with it
        manager.recv(4096)
