"""scry.accept: a StartupMessage answered in the accept callback, then the
socket handed to uvloop, on a real uvloop loop and real loopback sockets.
Both twins (the compiled Acceptor and PyAcceptor) go through every case."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from scry import accept

ACCEPTORS = [pytest.param(accept.PyAcceptor, id="python")]
if accept.COMPILED:  # (a build without a C compiler has the Python twin only)
    ACCEPTORS.append(pytest.param(accept.Acceptor, id="compiled"))

_PARAMS = b"user\0app\0database\0app\0\0"
STARTUP = struct.pack("!ii", 8 + len(_PARAMS), 196608) + _PARAMS
SSL_REQUEST = struct.pack("!ii", 8, 80877103)


class Recording(asyncio.Protocol):
    """A client protocol: what it was told, in order; ``reply`` answers data."""

    def __init__(self, reply: Callable[[Recording, bytes], None] | None = None) -> None:
        self.transport: Any = None
        self.events: list[tuple[str, Any]] = []
        self.reply = reply
        self.lost = asyncio.get_running_loop().create_future()
        self.got_data = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.events.append(("made", type(transport).__name__))

    def data_received(self, data: bytes) -> None:
        self.events.append(("data", data))
        self.got_data.set()
        if self.reply is not None:
            self.reply(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(("lost", exc))
        if not self.lost.done():
            self.lost.set_result(exc)

    def received(self) -> bytes:
        return b"".join(d for kind, d in self.events if kind == "data")


def run(acceptor: type, scenario: Callable[..., Awaitable[None]], **kwargs: Any) -> None:
    """Serve a ClientListener with ``acceptor`` on uvloop and run ``scenario``."""

    async def main() -> None:
        made = Clients()
        reply = kwargs.pop("reply", None)

        def new_client() -> Recording:
            return made.add(Recording(reply))

        (listening,) = accept.bind_client_listeners("127.0.0.1", 0, backlog=16, reuse_port=False)
        # As the proxy sets it: accepted with the first bytes already queued.
        listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
        listener = accept.ClientListener([listening], new_client, acceptor)
        await listener.start_serving()
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setblocking(False)
        try:
            await loop.sock_connect(client, listening.getsockname())
            await asyncio.wait_for(scenario(loop, client, made), 10)
        finally:
            client.close()
            listener.close()

    uvloop.run(main())


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = await loop.sock_recv(sock, n - len(out))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return out


async def read_by_uvloop(server_side: Any) -> None:
    """Until the kernel holds nothing more for the server's socket."""
    with socket.socket(fileno=os.dup(server_side.fileno())) as sock:
        while True:
            try:
                sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            await asyncio.sleep(0)


class Clients(list[Recording]):
    """The protocols the listener made, in order; ``nth`` waits for one."""

    def __init__(self) -> None:
        super().__init__()
        self.grew = asyncio.Event()

    def add(self, protocol: Recording) -> Recording:
        self.append(protocol)
        self.grew.set()
        return protocol

    async def nth(self, n: int) -> Recording:
        while len(self) <= n:
            self.grew.clear()
            await self.grew.wait()
        return self[n]


def answer_with(text: bytes) -> Callable[[Recording, bytes], None]:
    def reply(protocol: Recording, data: bytes) -> None:
        protocol.transport.write(text + b":" + data[:4])

    return reply


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_a_startup_message_is_answered_early_and_the_rest_comes_through_uvloop(
    acceptor: type,
) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        first = await recv_exactly(loop, client, 11)
        assert first == b"answer:" + STARTUP[:4]
        protocol = await made.nth(0)
        # Answered through the early transport, which knew the peer.
        assert protocol.events[0][0] == "made" and "Early" in protocol.events[0][1], protocol.events
        await loop.sock_sendall(client, b"password")
        assert await recv_exactly(loop, client, 11) == b"answer:pass"
        assert type(protocol.transport).__name__ == "TCPTransport"
        assert protocol.received() == STARTUP + b"password"
        assert [kind for kind, _ in protocol.events] == ["made", "data", "data"]
        client.close()
        assert await protocol.lost is None

    run(acceptor, scenario, reply=answer_with(b"answer"))


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_the_early_transport_knows_both_addresses(acceptor: type) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        protocol = await made.nth(0)
        await protocol.got_data.wait()
        assert seen == [client.getsockname(), client.getpeername()]

    seen: list[Any] = []

    def reply(protocol: Recording, data: bytes) -> None:
        seen.append(protocol.transport.get_extra_info("peername"))
        seen.append(protocol.transport.get_extra_info("sockname"))

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_other_first_bytes_are_left_for_uvloops_transport(acceptor: type) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, SSL_REQUEST)
        assert await recv_exactly(loop, client, 9) == b"N:" + SSL_REQUEST[:7]
        protocol = made[0]
        assert protocol.events[0] == ("made", "TCPTransport")
        assert protocol.received() == SSL_REQUEST

    def reply(protocol: Recording, data: bytes) -> None:
        protocol.transport.write(b"N:" + data[:7])

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_a_client_refused_in_the_accept_callback_gets_its_answer_then_eof(
    acceptor: type,
) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        assert await recv_exactly(loop, client, 7) == b"refused"
        assert await loop.sock_recv(client, 10) == b""  # closed by the proxy
        protocol = made[0]
        assert await protocol.lost is None
        assert [kind for kind, _ in protocol.events] == ["made", "data", "lost"]

    def reply(protocol: Recording, data: bytes) -> None:
        protocol.transport.write(b"refused")
        protocol.transport.close()

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_a_pause_asked_for_before_the_hand_over_holds_reads_until_resumed(
    acceptor: type,
) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        assert await recv_exactly(loop, client, 6) == b"paused"
        protocol = made[0]
        await loop.sock_sendall(client, b"more")
        await read_by_uvloop(protocol.transport.get_extra_info("socket"))
        assert protocol.received() == STARTUP, "read while the client was paused"
        protocol.reply = None
        protocol.transport.resume_reading()
        assert protocol.received() == STARTUP + b"more"  # what was held, at once
        assert type(protocol.transport).__name__ == "TCPTransport"
        await loop.sock_sendall(client, b"after")
        while protocol.received() != STARTUP + b"moreafter":
            protocol.got_data.clear()
            await protocol.got_data.wait()

    def reply(protocol: Recording, data: bytes) -> None:
        protocol.transport.pause_reading()
        protocol.transport.write(b"paused")

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_a_protocol_set_on_the_early_transport_gets_what_follows(acceptor: type) -> None:
    """As the PgBouncer console takes a login over (scry.pgbouncer.console)."""

    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        assert await recv_exactly(loop, client, 5) == b"moved"
        await loop.sock_sendall(client, b"query")
        await successor.got_data.wait()
        assert successor.received() == b"query"
        assert made[0].received() == STARTUP
        assert type(successor.transport).__name__ == "TCPTransport"

    successor: Recording

    def reply(protocol: Recording, data: bytes) -> None:
        nonlocal successor
        successor = Recording()
        successor.transport = protocol.transport
        protocol.transport.set_protocol(successor)
        protocol.transport.write(b"moved")

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_what_send_did_not_take_goes_out_first_through_uvloop(acceptor: type) -> None:
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than a socket buffer takes at once

    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        await loop.sock_sendall(client, STARTUP)
        protocol = await made.nth(0)
        await protocol.got_data.wait()
        assert protocol.transport.get_write_buffer_size() > 0
        got = await recv_exactly(loop, client, len(big) + 4)
        assert got == big + b"tail"

    def reply(protocol: Recording, data: bytes) -> None:
        protocol.transport.write(big)
        protocol.transport.write(b"tail")

    run(acceptor, scenario, reply=reply)


@pytest.mark.parametrize("acceptor", ACCEPTORS)
def test_a_protocol_that_fails_on_its_startup_loses_its_connection_not_the_listener(
    acceptor: type,
) -> None:
    async def scenario(loop: Any, client: socket.socket, made: Clients) -> None:
        reported: list[BaseException] = []
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
        await loop.sock_sendall(client, STARTUP)
        assert await loop.sock_recv(client, 10) == b""  # closed
        assert await made[0].lost is None
        assert [type(exc) for exc in reported] == [RuntimeError]
        # The listener carries on.
        with socket.socket() as second:
            second.setblocking(False)
            await loop.sock_connect(second, client.getpeername())
            await loop.sock_sendall(second, b"\0\0\0\x08\x04\xd2\x16\x2f")  # (an SSLRequest)
            await (await made.nth(1)).got_data.wait()
            assert made[1].received() == SSL_REQUEST

    def reply(protocol: Recording, data: bytes) -> None:
        if data == STARTUP:
            raise RuntimeError("a bug in the protocol")

    run(acceptor, scenario, reply=reply)


SERVE_WITH_FEW_DESCRIPTORS = """
import asyncio, os, resource, sys
import uvloop
from scry import accept

class Ok(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
    def data_received(self, data):
        self.transport.write(b"ok")

async def main():
    (listening,) = accept.bind_client_listeners("127.0.0.1", 0, backlog=64, reuse_port=False)
    listener = accept.ClientListener([listening], Ok, getattr(accept, sys.argv[1]))
    await listener.start_serving()
    room = len(os.listdir("/proc/self/fd")) + 3  # three clients, then EMFILE
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(listening.getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

uvloop.run(main())
"""


@pytest.mark.parametrize(
    "acceptor", ["PyAcceptor", "Acceptor"] if accept.COMPILED else ["PyAcceptor"]
)
def test_out_of_descriptors_the_listener_waits_says_so_once_and_recovers(acceptor: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_FEW_DESCRIPTORS, acceptor],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    port = int(proc.stdout.readline())

    def ask() -> bytes:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.settimeout(0.3)
        sock.sendall(b"hello")
        held.append(sock)
        try:
            return sock.recv(2)
        except TimeoutError:
            return b""

    held: list[socket.socket] = []
    try:
        answers = [ask() for _ in range(6)]
        assert answers[:3] == [b"ok"] * 3 and answers[3:] == [b""] * 3
        for sock in held[:3]:
            sock.close()
        held[3].settimeout(5)  # waited in the backlog: served once descriptors are back
        assert held[3].recv(2) == b"ok"
    finally:
        for sock in held:
            sock.close()
        _, err = proc.communicate(b"", timeout=10)
    assert err.decode().count("accept failed; retrying") == 1, err.decode()
