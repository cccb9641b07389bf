"""Peering: cancel forwarding, shared breaker state and rolling restarts.

A PostgreSQL CancelRequest arrives on a new connection, and with several
workers behind one ``SO_REUSEPORT`` port (or several hosts behind a TCP load
balancer) the kernel may hand it to a process that does not know the key.
Every cancel key therefore says who owns it. The BackendKeyData pid scry
gives a client is a positive int32::

    bit  31      0 (the pid stays positive)
    bits 17..30  peer id       (config ``peer_id``, 0..16383, as PgBouncer's)
    bits 11..16  worker id     (0..63)
    bit  10      VIA_PEER:  forwarded once over TCP by another peer
    bit  9       VIA_LOCAL: forwarded once over a local socket by another worker
    bits 0..8    random        (with the 32 random bits of the secret: 41 bits,
                               more than PostgreSQL's own 32-bit secret)

Forwarding rules (so a request can never loop, whatever the configs say):

* the key is ours: cancel the client's query; done.
* another peer's key: forward it over TCP as a plain CancelRequest to
  ``peers[peer_id]``, with VIA_PEER set, only if neither flag is set yet.
  A peer that does not own a key it got from a peer drops it (PgBouncer's rule).
* our peer id but not found here: send it, with VIA_LOCAL set, to worker
  ``worker_id`` of this instance and of any other scry instance on this port
  (a rolling restart leaves the old one draining), only if VIA_LOCAL is not
  set yet. At most one TCP hop and one local hop.

Local traffic uses one Unix socket per worker, in a runtime directory private
to the user: ``$XDG_RUNTIME_DIR or /tmp`` + ``/scry-<uid>/<port>/<instance>/w<N>.sock``
(``instance`` is the supervisor's pid). One message per connection; the first
byte says what it is::

    b"C" + 16-byte CancelRequest        a forwarded cancel
    b"J" + one JSON object + b"\\n"      {"op": "breaker", ...} a breaker transition
                                        {"op": "takeover"} a rolling restart: the
                                        reply carries the listening sockets (SCM_RIGHTS)
                                        {"op": "admin", "view": ...} an admin request
                                        from worker 0: the reply is one JSON document,
                                        then EOF (scry.adminapi.local)
                                        {"op": "tail", "filter": {...}} worker 0's live
                                        tail: NDJSON events until either side closes
                                        (scry.adminapi.tail)
                                        {"op": "health", "databases": {...}} what a
                                        worker's health monitors saw, second by second
                                        (scry.health: HealthMonitor.merge)

Breaker sharing: when a worker's breaker opens or closes, it tells the other
workers of its instance, which trip (``hold`` as the origin's) or reset theirs;
a transition applied from a message is not sent on, so nothing echoes.

Observability: only worker 0 serves the admin API; it asks the other workers
over these sockets and merges their answers (scry.adminapi.instance). A
worker answers from its event loop with the same short reads as the HTTP
handlers; worker 0 gives each one a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scry.breaker import CLOSED, OPEN, BreakerState, CircuitBreaker, Transition
from scry.config import split_host_port
from scry.log import event
from scry.protocol.startup import CANCEL_REQUEST_CODE, cancel_request

if TYPE_CHECKING:
    from scry.proxy import Proxy

__all__ = [
    "KEY_MASK",
    "MAX_PEER_ID",
    "RANDOM_MASK",
    "VIA_LOCAL",
    "VIA_PEER",
    "Peering",
    "cancel_pid_base",
    "key_owner",
    "new_cancel_key",
    "remove_instance_dir",
    "runtime_root",
]

PEER_SHIFT = 17
WORKER_SHIFT = 11
MAX_PEER_ID = (1 << 14) - 1
WORKER_MASK = (1 << 6) - 1
VIA_PEER = 1 << 10
VIA_LOCAL = 1 << 9
RANDOM_MASK = (1 << 9) - 1
#: A registered key never has the hop flags set: mask them off to look one up.
KEY_MASK = 0x7FFFFFFF & ~(VIA_PEER | VIA_LOCAL)

CONNECT_TIMEOUT = 2.0
TAKEOVER_TIMEOUT = 5.0
ADMIN_WRITE_TIMEOUT = 5.0  # worker 0 gives up after a second; never hold a reply longer
WATCHDOG_INTERVAL = 1.0
_CANCEL = struct.Struct("!iiiI")


# Cancel keys come from the OS's CSPRNG, as PostgreSQL's and PgBouncer's do: a
# Mersenne Twister's keys can be predicted from the ones a client is shown,
# and a predicted key cancels someone else's query. Read 4 KiB at a time, as
# 512 ready 64-bit words (a pop per login: every login draws a key).
_key_words: list[int] = []
_WORDS = struct.Struct("<512Q")
os.register_at_fork(after_in_child=_key_words.clear)  # a forked child draws its own


def cancel_pid_base(peer_id: int, worker_id: int) -> int:
    """The owner bits of a cancel key's pid (its random bits are zero)."""
    return (peer_id << PEER_SHIFT) | (worker_id << WORKER_SHIFT)


def new_cancel_key(peer_id: int, worker_id: int) -> tuple[int, int]:
    """A fresh (pid, secret) that names its owner (peer and worker). (The
    compiled relay draws the keys of the logins it serves itself, the same
    way: ClientCore._login_done.)"""
    if not _key_words:
        _key_words.extend(_WORDS.unpack(os.urandom(_WORDS.size)))
    bits = _key_words.pop()  # 9 bits of pid (never all zero), 32 of secret
    pid = cancel_pid_base(peer_id, worker_id) | ((bits >> 32) & RANDOM_MASK or 1)
    return pid, bits & 0xFFFFFFFF


def key_owner(pid: int) -> tuple[int, int]:
    """(peer id, worker id) encoded in a cancel key's pid."""
    return (pid >> PEER_SHIFT) & MAX_PEER_ID, (pid >> WORKER_SHIFT) & WORKER_MASK


# --------------------------------------------------------------------------- #
# The runtime directory
# --------------------------------------------------------------------------- #


def runtime_root(port: int) -> Path:
    """``<runtime>/scry-<uid>/<port>``: one directory per instance below it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"scry-{os.getuid()}" / str(port)


def _private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700); refuse a ``scry-<uid>`` directory someone else owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    top = path.parent.parent
    if top.stat().st_uid != os.getuid():
        raise OSError(f"{top} belongs to another user")
    return path


def remove_instance_dir(port: int, instance: int) -> None:
    """Remove an instance's directory (its sockets are gone with its workers)."""
    _remove_dir(runtime_root(port) / str(instance))


def _remove_dir(instance_dir: Path) -> None:
    shutil.rmtree(instance_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        instance_dir.parent.rmdir()  # the port's directory, once no instance is left


def _alive(sock_path: Path) -> bool:
    """Someone listens on this socket (a dead instance leaves only the file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def _instances(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    except FileNotFoundError:
        return []


def _live_instances(root: Path, own: int) -> list[Path]:
    """Other instances on this port with a live worker; stale ones are removed."""
    result = []
    for inst in _instances(root):
        if inst.name == str(own):
            continue
        if any(_alive(s) for s in inst.glob("w*.sock")):
            result.append(inst)
        else:
            shutil.rmtree(inst, ignore_errors=True)  # a killed instance's leftovers
    return result


# --------------------------------------------------------------------------- #
# Peering for one worker
# --------------------------------------------------------------------------- #


class Peering:
    """The local socket of one worker, cancel forwarding and breaker sharing."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.identity = proxy.identity
        self.worker_id = proxy.identity.worker_id
        self.dir: Path | None = None
        self.socket_path: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._applying = False  # a breaker transition from another worker
        self.forwarded = 0  # cancels sent on (to a worker or a peer)
        self.dropped = 0  # cancels nobody here owns and that may not hop again
        # --replace: what the instance it took the port from was set to
        # (scry.adminapi.local.replaced_state), or None.
        self.replaced_state: dict[str, Any] | None = None

    @property
    def peer_id(self) -> int:
        """``peer_id``, or a pgbouncer.ini's ``peer_id`` when scry runs from one."""
        config = self.proxy.config
        compat = getattr(config, "pgbouncer", None)
        return config.peer_id or (compat.peer_id if compat is not None else 0)

    # --- lifecycle ------------------------------------------------------------------

    def take_over_listeners(self) -> list[socket.socket]:
        """Before binding: the listening sockets to use, or [] to bind fresh ones.

        With ``--replace`` this worker takes the listening sockets of workers
        ``j ≡ worker_id (mod workers)`` of the instance already serving the
        port; they start draining (SHUTDOWN WAIT_FOR_CLIENTS). Connections
        waiting in those sockets' accept queues are accepted here, so none is
        refused. Without ``--replace``, another serving instance is an error.
        """
        port = self.proxy.config.listen_host_port[1]
        if port == 0:
            return []
        root = runtime_root(port)
        others = _live_instances(root, self.identity.instance)
        if not self.identity.replace:
            serving = [inst for inst in others if not (inst / "draining").exists()]
            if serving and not self.proxy.config.so_reuseport:
                raise OSError(
                    f"another scry instance (pid {serving[0].name}) serves port {port}; "
                    "start with --replace for a rolling restart"
                )
            return []
        taken: list[socket.socket] = []
        old_workers = [path for inst in others for path in sorted(inst.glob("w*.sock"))]
        for sock_path in old_workers:
            j = int(sock_path.stem[1:])
            if j % self.identity.workers == self.worker_id:
                socks, state = _request_takeover(sock_path)
                taken += socks
                if state is not None and self.replaced_state is None:
                    self.replaced_state = state
        if taken:
            event("took over listening sockets", sockets=len(taken))
        if self.replaced_state is None and old_workers:
            # More workers than the old instance had: this one took no
            # sockets, and asks for the state alone.
            self.replaced_state = _request_state(old_workers[0])
        return taken

    def locate(self, port: int) -> Path:
        """The directory of this instance's peering sockets (made if missing);
        known before ``start`` to a worker that asks the others first."""
        if self.dir is None:
            self.dir = _private_dir(runtime_root(port) / str(self.identity.instance))
        return self.dir

    async def start(self) -> None:
        """Listen on this worker's Unix socket (after the TCP listener is up)."""
        try:
            path = self.locate(self.proxy.listen_port) / f"w{self.worker_id}.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._server = await asyncio.start_unix_server(self._on_connection, str(path))
            os.chmod(path, 0o600)
            self.socket_path = path
        except OSError as exc:
            event("peering socket unavailable: cancels for other workers will be lost",
                  logging.WARNING, error=str(exc))  # fmt: skip
            return
        if self.identity.workers > 1:
            self._spawn(self._watch_supervisor())

    def mark_draining(self) -> None:
        """This instance no longer serves new clients (a replacement may start)."""
        if self.dir is not None:
            with contextlib.suppress(OSError):
                (self.dir / "draining").touch()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
            self.socket_path = None
        if self.identity.workers == 1 and self.dir is not None:
            _remove_dir(self.dir)  # no supervisor to do it
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watch_supervisor(self) -> None:
        # A worker whose supervisor died (SIGKILL) must not live on unmanaged.
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            if os.getppid() != self.identity.instance:
                event("supervisor gone: draining", logging.WARNING)
                self.proxy.begin_drain()
                return

    # --- cancel forwarding --------------------------------------------------------------

    def forward_cancel(self, pid: int, secret: int) -> asyncio.Future[Any] | None:
        """A CancelRequest whose key is not in this worker's table; what
        completes once its owner has acted on it (None: dropped)."""
        if pid <= 0:
            return None
        peer, worker = key_owner(pid)
        timeout = self.proxy.config.timeouts.cancel_wait_timeout
        if peer != self.peer_id:
            addr = self.proxy.config.peers.get(peer)
            if addr is None or pid & (VIA_PEER | VIA_LOCAL):
                self.dropped += 1
                return None
            self.forwarded += 1
            # (Imported here: the compiled relay imports this module, and
            # scry.server imports the relay's core, so a module-level import
            # would leave scry._relay half-made and the relay uncompiled.)
            from scry.server import send_cancel_request

            address = split_host_port(addr)
            return self._spawn(
                send_cancel_request(address, pid | VIA_PEER, secret, timeout, to="peer")
            )
        if pid & VIA_LOCAL or self.dir is None:
            self.dropped += 1
            return None
        targets = [
            path
            for inst in _instances(self.dir.parent)
            if (path := inst / f"w{worker}.sock") != self.socket_path and path.exists()
        ]
        if not targets:
            self.dropped += 1
            return None
        self.forwarded += 1
        payload = b"C" + cancel_request(pid | VIA_LOCAL, secret)
        # (The worker that owns the key closes once PostgreSQL has acted.
        # return_exceptions: sends cancelled at exit leave nothing unretrieved.)
        return asyncio.gather(
            *(self._spawn(_send_unix(path, payload, timeout)) for path in targets),
            return_exceptions=True,
        )

    # --- breaker sharing ----------------------------------------------------------------

    def breaker_changed(self, breaker: CircuitBreaker, transition: Transition) -> None:
        """Tell the other workers of this instance that a breaker opened or closed."""
        if self._applying or self.identity.workers == 1 or self.dir is None:
            return
        if (
            transition.to_state not in (OPEN, CLOSED)
            or transition.from_state is transition.to_state
        ):
            return
        message = self.breaker_message(breaker, transition.to_state, transition.reason)
        payload = b"J" + json.dumps(message).encode() + b"\n"
        for path in self.dir.glob("w*.sock"):
            if path != self.socket_path:
                self._spawn(_send_unix(path, payload))

    def breaker_message(
        self, breaker: CircuitBreaker, state: BreakerState, reason: str
    ) -> dict[str, Any]:
        """What this worker tells the others of a breaker (``apply_breaker``)."""
        return {
            "op": "breaker", "db": breaker.name, "state": str(state), "held": breaker.held,
            "gone": breaker.opened_on_gone, "reason": reason, "worker": self.worker_id,
        }  # fmt: skip

    def apply_breaker(self, message: dict[str, Any]) -> None:
        """Another worker's breaker opened or closed: this one's does the same
        (and tells nobody)."""
        breaker = self.proxy.breaker_for(str(message["db"]))
        reason = f"worker {message.get('worker')}: {message.get('reason', '')}"
        self._applying = True
        try:
            if message["state"] == str(OPEN):
                breaker.trip(reason, hold=bool(message.get("held")), gone=bool(message.get("gone")))
            elif message["state"] == str(CLOSED):
                breaker.reset(reason)
        finally:
            self._applying = False

    # --- health sharing -----------------------------------------------------------------

    def share_health(self, seen: dict[str, list[list[Any]]]) -> None:
        """Tell the other workers what this one's health monitors observed
        (``HealthMonitor.take_unshared`` per database)."""
        if self.identity.workers == 1 or self.dir is None:
            return
        message = {"op": "health", "worker": self.worker_id, "databases": seen}
        payload = b"J" + json.dumps(message).encode() + b"\n"
        for path in self.dir.glob("w*.sock"):
            if path != self.socket_path:
                self._spawn(_send_unix(path, payload))

    def _apply_health(self, message: dict[str, Any]) -> None:
        for name, seconds in message["databases"].items():
            monitor = self.proxy.health.get(name)
            if monitor is None:
                continue  # (a database this worker does not judge)
            for sec, count, errors, buckets in seconds:
                monitor.merge(int(sec), int(count), int(errors),
                              {int(b): int(n) for b, n in buckets.items()})  # fmt: skip

    # --- the local socket ---------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            kind = await asyncio.wait_for(reader.read(1), CONNECT_TIMEOUT)
            if not kind:
                return  # a liveness probe (another instance starting on this port)
            if kind == b"C":
                body = await asyncio.wait_for(reader.readexactly(16), CONNECT_TIMEOUT)
                _length, code, pid, secret = _CANCEL.unpack(body)
                if code == CANCEL_REQUEST_CODE:
                    done = self.proxy.handle_cancel(pid, secret)
                    if done is not None:
                        await done  # (bounded by cancel_wait_timeout) then close
            elif kind == b"J":
                line = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
                message = json.loads(line)
                op = message.get("op")
                if op == "breaker":
                    self.apply_breaker(message)
                elif op == "health":
                    self._apply_health(message)
                elif op == "takeover":
                    await self._hand_over(writer)
                elif op == "admin":
                    await self._answer_admin(message, writer)
                elif op == "tail":
                    # Imported here: the admin layer builds on the proxy, not the reverse.
                    from scry.adminapi.tail import stream_tail

                    await stream_tail(self.proxy, message, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, KeyError) as exc:
            event("bad message on the peering socket", logging.WARNING, error=repr(exc))
        except asyncio.CancelledError:
            # This process is stopping with a request still in hand (a cancel
            # awaiting PostgreSQL, a console PAUSE): the asker sees the close.
            # Not re-raised: Python 3.11's asyncio.streams asks a cancelled
            # handler's task for its exception, which raises, and the loop
            # then logs a traceback.
            pass
        finally:
            writer.close()

    async def _answer_admin(self, message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """Worker 0 asks for this worker's view of something (scry.adminapi.local)."""
        from scry.adminapi.local import answer

        reply = await answer(self.proxy, message)
        try:
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), ADMIN_WRITE_TIMEOUT)
        except ConnectionError:
            pass  # worker 0 stopped waiting (its timeout): nobody to tell

    async def _hand_over(self, writer: asyncio.StreamWriter) -> None:
        """Rolling restart: give our listening sockets to the new instance, then drain."""
        proxy = self.proxy
        self.mark_draining()
        if proxy.admin is not None:
            await proxy.admin.stop()  # free its port for the new instance's admin
            proxy.admin = None
        # TCP listeners, and PgBouncer's Unix socket (scry.pgbouncer.console):
        # connections waiting in their accept queues are the new instance's.
        fds = [
            s.fileno()
            for server in proxy.listeners
            for s in server.sockets
            if s.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)
        ]
        # With them, what an operator set here (PAUSE, held breakers): the new
        # instance starts so, rather than as its config says. (Imported here:
        # the admin layer builds on the proxy, not the reverse.)
        from scry.adminapi.local import replaced_state

        state = json.dumps(replaced_state(proxy)).encode()
        transport_sock = writer.get_extra_info("socket")
        # Blocking send on a dup: the pseudo-socket of the transport has no sendmsg.
        with socket.socket(fileno=os.dup(transport_sock.fileno())) as conn:
            conn.setblocking(True)
            socket.send_fds(conn, [state], fds)
        proxy.listeners_handed_over = True  # (the Unix socket's file is theirs now)
        event("listening sockets handed over: draining until clients leave",
              sockets=len(fds), clients=len(proxy.clients))  # fmt: skip
        proxy.begin_drain(wait_for_clients=True)


def _request_takeover(sock_path: Path) -> tuple[list[socket.socket], dict[str, Any] | None]:
    """Ask one worker of the old instance for its listening sockets (blocking;
    at start), and the state an operator put it in (``replaced_state``; None
    from a scry that sends none)."""
    fds: list[int] = []
    try:
        data = _ask_old_worker(sock_path, {"op": "takeover"}, fds)
    except OSError as exc:
        if not fds:
            event("takeover failed; binding fresh sockets", logging.WARNING,
                  socket=str(sock_path), error=str(exc))  # fmt: skip
            return [], None
        data = b""  # (the sockets came; the state did not)
    try:
        state = json.loads(data)
    except ValueError:  # (an older scry says b"ok")
        state = None
    return [socket.socket(fileno=fd) for fd in fds], state if isinstance(state, dict) else None


def _request_state(sock_path: Path) -> dict[str, Any] | None:
    """A worker of the old instance's ``replaced_state`` (blocking; at start)."""
    try:
        data = _ask_old_worker(sock_path, {"op": "admin", "view": "replaced_state"})
        state = json.loads(data)["ok"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        event("could not ask the replaced instance's state", logging.WARNING,
              socket=str(sock_path), error=repr(exc))  # fmt: skip
        return None
    return state if isinstance(state, dict) else None


def _ask_old_worker(
    sock_path: Path, request: dict[str, Any], fds: list[int] | None = None
) -> bytes:
    """Send ``request`` to a worker of the old instance and read its whole
    answer (blocking; at start). ``fds``, if given, receives the descriptors
    that come with the answer's first part."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(TAKEOVER_TIMEOUT)
        conn.connect(str(sock_path))
        conn.sendall(b"J" + json.dumps(request).encode() + b"\n")
        if fds is None:
            data = b""
        else:
            data, received, _flags, _addr = socket.recv_fds(conn, 65536, 64)
            fds.extend(received)
        while chunk := conn.recv(65536):  # (until the old worker closes)
            data += chunk
    return data


async def _send_unix(path: Path, payload: bytes, until_closed: float | None = None) -> None:
    """Send ``payload`` to a worker's socket; with ``until_closed``, wait (that
    long at most, 0 = no bound) for the worker to close the connection."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path)), CONNECT_TIMEOUT
        )
        try:
            writer.write(payload)
            await writer.drain()
            if until_closed is not None:
                await asyncio.wait_for(reader.read(), until_closed or None)
        finally:
            writer.close()
    except (OSError, TimeoutError):
        pass  # that worker is gone (restarting, or an instance that just stopped)
