"""SSH port forwards for ``ssh://[user@]host[:22]/ADMIN_HOST:ADMIN_PORT`` targets.

The console owns the tunnel: it runs the system ``ssh -N -L`` (so the
operator's ``~/.ssh/config``, agent, jump hosts and known_hosts all apply),
waits until the local end accepts connections, restarts ssh with backoff
when it exits (the local port stays the same, so the admin client's URL
does not change), and terminates it on exit.

``BatchMode=yes``: the console cannot answer a password prompt; use keys or
an agent. Extra ``ssh`` arguments come from the fleet file's
``ssh_options`` or ``$SCRY_SSH_OPTIONS`` (split like a shell would).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import socket

from scry_tui.targets import SSHSpec

log = logging.getLogger(__name__)

SSH_OPTIONS_ENV = "SCRY_SSH_OPTIONS"
READY_TIMEOUT = 15.0
MAX_BACKOFF = 15.0


class TunnelError(Exception):
    """The tunnel could not be opened (ssh missing, refused, forward failed)."""


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SSHTunnel:
    """``ssh -N -L 127.0.0.1:LOCAL:ADMIN_HOST:ADMIN_PORT [user@]host``, kept up."""

    def __init__(
        self,
        spec: SSHSpec,
        options: tuple[str, ...] = (),
        *,
        ssh: str | None = None,
        local_port: int | None = None,
    ) -> None:
        self.spec = spec
        env_options = tuple(shlex.split(os.environ.get(SSH_OPTIONS_ENV, "")))
        self.options = tuple(os.path.expanduser(o) for o in options + env_options)
        self.ssh = ssh or shutil.which("ssh") or "ssh"
        self.local_port = local_port or free_local_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.last_error: str | None = None
        self.restarts = 0
        self._supervisor: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def command(self) -> list[str]:
        forward = f"127.0.0.1:{self.local_port}:{self.spec.admin_host}:{self.spec.admin_port}"
        cmd = [
            self.ssh,
            "-N",
            "-L",
            forward,
            "-o", "ExitOnForwardFailure=yes",
            "-o", "BatchMode=yes",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "ConnectTimeout=10",
        ]  # fmt: skip
        if self.spec.port:
            cmd += ["-p", str(self.spec.port)]
        cmd += list(self.options)
        cmd.append(self.spec.destination)
        return cmd

    def check(self) -> None:
        """Raise :class:`TunnelError` if there is no ssh client to run."""
        if shutil.which(self.ssh) is None and not os.path.exists(self.ssh):
            raise TunnelError("the `ssh` client is not installed (needed for ssh:// targets)")

    def start(self) -> None:
        """Open the tunnel in the background and keep it open until :meth:`close`."""
        self.check()
        self._ready = asyncio.Event()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"tunnel {self.spec}")

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> bool:
        """Wait until the forward works (True) or ``timeout`` passes (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        return False

    async def _spawn_and_wait(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.command(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in the console must not kill ssh first
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                break
            if await self._accepts():
                self.last_error = None
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 0.1)
        error = await self._stderr_text()
        await self._kill()
        self.last_error = error or f"ssh did not open the forward within {READY_TIMEOUT:.0f}s"
        raise TunnelError(f"{self.spec}: {self.last_error}")

    async def _accepts(self) -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", self.local_port)
        except OSError:
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def _stderr_text(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        with contextlib.suppress(TimeoutError, ValueError):
            data = await asyncio.wait_for(self.proc.stderr.read(4096), 0.5)
            lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
            return lines[-1] if lines else ""
        return ""

    async def _supervise(self) -> None:
        """(Re)start ssh whenever it is not running, with backoff, until :meth:`close`."""
        backoff = 0.5
        first = True
        while not self._closed:
            try:
                await self._spawn_and_wait()
            except (TunnelError, OSError) as exc:
                self.last_error = str(exc)
                log.info("ssh tunnel %s: %s", self.spec, exc)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            if not first:
                self.restarts += 1
            first = False
            backoff = 0.5
            self._ready.set()
            assert self.proc is not None
            await self.proc.wait()
            self._ready.clear()
            if self._closed:
                return
            self.last_error = (await self._stderr_text()) or f"ssh exited ({self.proc.returncode})"
            log.info("ssh tunnel %s dropped: %s; reconnecting", self.spec, self.last_error)
            await asyncio.sleep(backoff)

    async def _kill(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 3)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop supervising and terminate ssh."""
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        await self._kill()
