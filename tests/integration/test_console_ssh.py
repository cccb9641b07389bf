"""ssh:// targets: the console opens ``ssh -L`` to a real sshd on loopback
(Debian's openssh-server, started here with its own host key and config),
reconnects when the tunnel drops, and closes it on exit."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scry.devcluster import free_port
from scry_tui.app import ScryConsole
from scry_tui.targets import make_target
from scry_tui.testing import refreshed

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
TOKEN = "t0k-ssh"

pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")),
    reason="needs openssh-server and openssh-client (apt-get install openssh-server openssh-client)",
)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[int, tuple[str, ...]]]:
    """A throwaway sshd on 127.0.0.1; yields (port, ssh client options)."""
    d = tmp_path / "sshd"
    d.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)  # fmt: skip
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nStrictModes no\nUsePAM no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
        "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\nLogLevel VERBOSE\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
    log = open(d / "sshd.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.skip(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.05)
    options = (
        "-F", "/dev/null", "-i", str(d / "client_key"), "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={d / 'known_hosts'}",
        "-o", "LogLevel=ERROR",
    )  # fmt: skip
    try:
        yield port, options
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture
def admin_proxy(scry_proxy):
    port = free_port()
    proxy = scry_proxy({"admin": {"enabled": True, "listen_addr": f"127.0.0.1:{port}", "token": TOKEN}})  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    return proxy, port


async def test_console_over_an_ssh_tunnel_reconnects_and_closes(sshd, admin_proxy) -> None:
    ssh_port, options = sshd
    _, admin_port = admin_proxy
    user = getpass.getuser()
    target = make_target(
        f"ssh://{user}@127.0.0.1:{ssh_port}/127.0.0.1:{admin_port}",
        name="remote",
        token=TOKEN,
        ssh_options=options,
    )
    app = ScryConsole([target], refresh=0.5)
    async with app.run_test(size=(160, 44)) as pilot:
        tunnel = app.tunnels["remote"]
        assert await tunnel.wait_ready(20), tunnel.last_error
        await refreshed(pilot, app, 1)
        state = app.states["remote"]
        assert state.up, state.last_error
        assert state.status is not None and state.status.admin_addr.endswith(str(admin_port))
        first_pid = tunnel.proc.pid

        tunnel.proc.kill()  # the tunnel drops
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (tunnel.restarts < 1 or not tunnel._ready.is_set()):
            await pilot.pause(0.1)
        assert tunnel.restarts == 1 and tunnel.proc.pid != first_pid, tunnel.last_error
        await refreshed(pilot, app, 1)
        assert state.up, state.last_error
        proc = tunnel.proc
    # Quitting closes the tunnel.
    assert proc.returncode is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=1).close()
