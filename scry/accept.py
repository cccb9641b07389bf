"""Client listeners that answer a login's StartupMessage in the accept callback.

uvloop's own listener makes a transport and a protocol for each connection,
calls ``connection_made`` a loop turn later, registers the socket with epoll
and reads the StartupMessage after one more ``epoll_wait``, although
``TCP_DEFER_ACCEPT`` had it queued before ``accept()`` returned. A login
waits for all of that before its password challenge (docs/benchmarks.md,
session 40: ~15-20 µs more than PgBouncer for that first answer).

:class:`ClientListener` does what PgBouncer does instead. Its reader
callback (an ``Acceptor``) accepts, peeks at the first bytes and, when they
are one whole StartupMessage, reads them and lets the client answer through
an ``EarlyTransport`` (plain ``send()`` on the socket). Then it hands the
socket to uvloop (``connect_accepted_socket``) while the client works out
its password, with the early transport as the first protocol of uvloop's:
its ``connection_made`` passes on what it was told (unsent bytes, a close,
a paused reader) and gives uvloop's transport to the client, which keeps
it in ``transport`` as every scry protocol does. Any other first bytes
(SSLRequest, CancelRequest, direct TLS, a partial packet) are left unread
for uvloop's transport, as before.

``Acceptor``, ``EarlyTransport`` and ``Adoption`` are compiled from
scry/_accept.pyx when a C compiler was at hand; the ``Py`` classes here are
their pure-Python twins and the reference.
"""

from __future__ import annotations

import _socket
import asyncio
import errno
import logging
import math
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from scry.log import event

PROTOCOL_3_0 = b"\x00\x03\x00\x00"
# A StartupMessage longer than this is left to the transport (PostgreSQL's
# own limit is 10,000 bytes; a login's is a few dozen).
PEEK_SIZE = 2048
# accept() failing for want of these: the listener stops accepting for
# RETRY_AFTER seconds (the connections wait in the backlog) rather than spin
# on a socket that stays ready.
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_AFTER = 0.1

_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


def whole_startup_message(head: bytes) -> bool:
    """``head`` is exactly one protocol-3.0 StartupMessage, nothing before or after it."""
    n = len(head)
    return n >= 8 and head[4:8] == PROTOCOL_3_0 and int.from_bytes(head[:4], "big") == n


class _AcceptedSocket(_socket.socket):
    """An accepted socket for ``connect_accepted_socket``. libuv closes the
    descriptor with its transport and uvloop then calls ``close()`` here,
    which must not close it again (the number may be reused by then)."""

    __slots__ = ()

    def close(self) -> None:
        self.detach()


class PyAdoption:
    """``connect_accepted_socket`` run without a Task: it sets the transport
    up at once, then only waits for ``connection_made``; its end is resumed
    from the wait's done callback."""

    __slots__ = ("_coro", "_early")

    def __init__(self) -> None:
        self._coro: Coroutine[Any, Any, Any] | None = None
        self._early: PyEarlyTransport | None = None

    def start(self, coro: Coroutine[Any, Any, Any], early: PyEarlyTransport | None) -> None:
        self._early = early  # (told if the transport fails before connection_made)
        try:
            waiter = coro.send(None)
        except StopIteration:
            return
        except Exception as exc:
            self._failed(exc)
            return
        self._coro = coro
        waiter.add_done_callback(self._resume)

    def _resume(self, _: object) -> None:
        coro, self._coro = self._coro, None
        assert coro is not None
        try:
            coro.send(None)
        except StopIteration:
            pass
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if self._early is not None:
            self._early._adoption_failed(exc)
        self._early = None


class PyAcceptor:
    """A listening socket's reader callback: one connection per call (the
    reader is level-triggered, so a backlog drains over the next turns, and
    no accept() is spent on EAGAIN)."""

    __slots__ = ("_listening", "_loop", "_new_client", "_failed")

    def __init__(
        self,
        listening: socket.socket,
        loop: asyncio.AbstractEventLoop,
        new_client: Callable[[], asyncio.Protocol],
        failed: Callable[[int], None],
    ) -> None:
        self._listening = listening
        self._loop = loop
        self._new_client = new_client
        self._failed = failed  # failed(errno): accept() is out of descriptors

    def __call__(self) -> None:
        listening = self._listening
        try:
            fd, peer = listening._accept()  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                self._failed(exc.errno)
            return  # EAGAIN, or the connection went before we took it
        sock = _AcceptedSocket(listening.family, socket.SOCK_STREAM, 0, fd)
        try:
            head = sock.recv(PEEK_SIZE, _PEEK)
        except (BlockingIOError, InterruptedError):
            head = b""
        except OSError:  # reset before we read: nobody to tell
            _socket.socket.close(sock)
            return
        loop = self._loop
        if not whole_startup_message(head):  # left for uvloop's transport to read
            adoption = loop.connect_accepted_socket(self._new_client, sock)  # type: ignore[arg-type]
            PyAdoption().start(adoption, None)
            return
        sock.recv(len(head), socket.MSG_DONTWAIT)  # the bytes peeked at
        protocol = self._new_client()
        early = PyEarlyTransport(sock, peer, loop, protocol)
        try:
            protocol.connection_made(early)  # type: ignore[arg-type]
            protocol.data_received(head)
        except BaseException:  # (as uvloop's transport closes on a protocol's error)
            early.abort()
            raise
        early._adopt()


class PyEarlyTransport:
    """The transport of a client between ``accept()`` and uvloop's transport:
    what the client writes goes out with ``send()``; what it asks of the
    reader (pause, close) is passed on in :meth:`connection_made`."""

    __slots__ = (
        "_sock",
        "_peer",
        "_loop",
        "_protocol",
        "_unsent",
        "_paused",
        "_closing",
        "_aborting",
        "_adopting",
        "_handed",
        "_fd_closed",
        "_real",
        "_held",
    )

    def __init__(
        self,
        sock: _AcceptedSocket,
        peer: Any,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.Protocol,
    ) -> None:
        self._sock = sock
        self._peer = peer
        self._loop = loop
        self._protocol = protocol
        self._unsent: bytearray | None = None  # what send() did not take
        self._paused = False
        self._closing = False
        self._aborting = False
        self._adopting = False  # uvloop owns the descriptor
        self._handed = False  # uvloop's transport has called connection_made
        self._fd_closed = False  # closed by us, before uvloop took it
        # While the client wants no reads at the hand-over: uvloop's
        # transport, and what it read meanwhile (see connection_made).
        self._real: asyncio.Transport | None = None
        self._held: list[bytes] | None = None

    # --- the transport the client sees ----------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        real = self._real
        if real is not None:
            real.write(data)
            return
        if self._closing or not data:
            return
        if self._unsent is not None:
            self._unsent += data
            return
        try:
            sent = self._sock.send(data, _SEND_FLAGS)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:  # the client is gone
            self._lost(exc)
            return
        if sent < len(data):
            self._unsent = bytearray(memoryview(data)[sent:])

    def close(self) -> None:
        if self._real is not None:
            self._real.close()
            return
        self._closing = True
        if not self._unsent:  # (else once uvloop's transport has sent it)
            self._close_now(None)

    def abort(self) -> None:
        if self._real is not None:
            self._real.abort()
            return
        self._closing = self._aborting = True
        self._unsent = None
        self._close_now(None)

    def is_closing(self) -> bool:
        return self._real.is_closing() if self._real is not None else self._closing

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        if self._held is not None:
            self._release_reads()

    def is_reading(self) -> bool:
        return not (self._paused or self._closing)

    def get_write_buffer_size(self) -> int:
        if self._real is not None:
            return self._real.get_write_buffer_size()
        return len(self._unsent) if self._unsent else 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if self._real is not None:
            return self._real.get_extra_info(name, default)
        if name == "peername":
            return self._peer
        if name == "sockname":
            return self._sock.getsockname()
        if name == "socket":
            return self._sock
        return default

    # --- the hand-over to uvloop's transport ----------------------------------------------

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment] # (how the console takes a login over)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def _adopt(self) -> None:
        if self._fd_closed:
            return
        self._adopting = True
        adoption = self._loop.connect_accepted_socket(self, self._sock)  # type: ignore[arg-type,type-var]
        PyAdoption().start(adoption, self)

    def __call__(self) -> PyEarlyTransport:
        """(The protocol factory given to connect_accepted_socket.)"""
        return self

    # --- uvloop's transport's first protocol: the hand-over -------------------------------

    def connection_made(self, real: asyncio.Transport) -> None:
        """uvloop's transport is the client's from now on: its protocol keeps
        it in ``transport``, as every scry protocol does, and hears from it
        directly (called before uvloop starts reading)."""
        self._handed = True
        if self._unsent:
            real.write(bytes(self._unsent))
        self._unsent = None
        if self._closing:  # (connection_lost then comes through here)
            real.abort() if self._aborting else real.close()
        elif self._paused:
            # uvloop starts reading right after connection_made, whatever
            # happened in it: until the client resumes, this object stays its
            # transport, in front of uvloop's, and keeps what is read meanwhile.
            self._real = real
            self._held = []
        else:
            self._protocol.transport = real  # type: ignore[attr-defined]
            real.set_protocol(self._protocol)

    def _release_reads(self) -> None:
        real, held, protocol = self._real, self._held, self._protocol
        assert real is not None and held is not None
        self._held = None
        protocol.transport = real  # type: ignore[attr-defined]
        real.set_protocol(protocol)
        for data in held:
            if real.is_closing():
                break
            protocol.data_received(data)
        real.resume_reading()

    # (While reads are held.)

    def data_received(self, data: bytes) -> None:
        assert self._real is not None and self._held is not None
        self._real.pause_reading()
        self._held.append(data)

    def eof_received(self) -> None:
        return None  # close: what was held is moot

    def connection_lost(self, exc: Exception | None) -> None:
        self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()

    # --- the end before uvloop's transport -------------------------------------------------

    def _close_now(self, exc: Exception | None) -> None:
        # (Once uvloop has the descriptor, connection_made closes its transport instead.)
        if self._adopting or self._fd_closed:
            return
        self._fd_closed = True
        _socket.socket.close(self._sock)  # (not the detaching close: ours still)
        self._loop.call_soon(self._protocol.connection_lost, exc)

    def _lost(self, exc: Exception) -> None:
        self._closing = True
        self._unsent = None
        self._close_now(exc)

    def _adoption_failed(self, exc: Exception) -> None:
        # uvloop's transport closed before connection_made (and closed the
        # descriptor), so the client would never hear of it.
        if not self._handed:
            self._protocol.connection_lost(exc)


try:  # the compiled twins, built by setup.py when a C compiler is at hand
    from scry._accept import Acceptor  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - a build without a C compiler
    Acceptor = PyAcceptor

#: True when the compiled twins serve the listeners.
COMPILED = Acceptor is not PyAcceptor


class ClientListener(asyncio.AbstractServer):
    """Listening TCP sockets whose connections scry accepts itself (see the
    module docstring); the proxy uses it as it would an ``asyncio.Server``."""

    def __init__(
        self,
        socks: list[socket.socket],
        new_client: Callable[[], asyncio.Protocol],
        acceptor: type = Acceptor,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._socks = socks
        self._new_client = new_client
        self._acceptor = acceptor
        self._serving = False
        self._servers: list[asyncio.Server] = []  # (on a loop that is not uvloop)
        self._starved_logged = -math.inf  # (out of descriptors: said once a minute at most)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._socks)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        if self._serving:
            return
        self._serving = True
        if not type(self._loop).__module__.startswith("uvloop"):
            # asyncio's connect_accepted_socket wants a socket object it may
            # close itself: there, its own listener (as in an in-process test).
            for sock in self._socks:
                self._servers.append(await self._loop.create_server(self._new_client, sock=sock))
            return
        for sock in self._socks:
            sock.setblocking(False)
            self._accept_from(sock)

    def _accept_from(self, sock: socket.socket) -> None:
        def failed(code: int) -> None:
            self._out_of_descriptors(sock, code)

        self._loop.add_reader(
            sock.fileno(), self._acceptor(sock, self._loop, self._new_client, failed)
        )

    def close(self) -> None:
        for server in self._servers:
            server.close()
        for sock in self._socks:
            if self._serving and not self._servers:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._socks = []
        self._servers = []
        self._serving = False

    async def wait_closed(self) -> None:
        return None

    async def serve_forever(self) -> None:
        raise NotImplementedError("scry runs the loop itself")

    def _out_of_descriptors(self, sock: socket.socket, code: int) -> None:
        now = time.monotonic()
        if now - self._starved_logged >= 60:
            self._starved_logged = now
            event("accept failed; retrying", logging.WARNING, error=errno.errorcode.get(code),
                  retry_s=RETRY_AFTER)  # fmt: skip
        self._loop.remove_reader(sock.fileno())

        def again() -> None:
            if self._serving and sock in self._socks:
                self._accept_from(sock)

        self._loop.call_later(RETRY_AFTER, again)


def bind_client_listeners(
    host: str, port: int, *, backlog: int, reuse_port: bool
) -> list[socket.socket]:
    """The listening sockets for ``host:port``, one per address it resolves to
    (as ``loop.create_server`` binds them)."""
    infos = socket.getaddrinfo(
        host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
    )
    socks: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise OSError(
                    exc.errno, f"error while attempting to bind on address {addr!r}: {exc.strerror}"
                ) from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks
