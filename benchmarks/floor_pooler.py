#!/usr/bin/env python3
"""The floor: about the cheapest transaction pooler Python can be, for bench.py.

This shows what plain asyncio + uvloop can do on this machine when a pooler
does almost nothing, so benchmark runs can show how far scry is from that floor
next to PgBouncer. It is not a usable pooler. Per connection it does:

* clients: SSLRequest -> ``N``; StartupMessage -> md5 password auth against the one
  configured user; then AuthenticationOk, the ParameterStatus messages from the
  first server connection's greeting, a made-up BackendKeyData and ReadyForQuery;
* servers: up to ``--pool-size`` connections, the first opened at startup and the
  rest lazily, logging in with SCRAM-SHA-256 (scramp), md5, cleartext or trust;
* transaction pooling: a client's bytes go, whole chunk by whole chunk, to an
  idle server (or wait FIFO for one). The server's replies go back the same way
  until a chunk ends on a message boundary with ReadyForQuery 'I'; then the
  server goes to the next waiting client or back to the idle list.

Messages are framed only by their 5-byte header (type byte + int32 length);
nothing is parsed or copied. It deliberately leaves out everything else: TLS,
config files, logging and metrics, cancel requests, flow control (no
pause_reading), timeouts, several users or databases (every client gets the
configured database), resetting session state (a client that leaves
mid-transaction just closes its server connection) and graceful shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import struct
import sys
from collections import deque

import scramp
import uvloop

SSL_REQUEST, GSSENC_REQUEST, PROTOCOL_3 = 80877103, 80877104, 196608
Z, X, IDLE = ord("Z"), ord("X"), ord("I")


def message(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("!I", len(payload) + 4) + payload


def md5_password(user: str, password: str, salt: bytes) -> bytes:
    inner = hashlib.md5((password + user).encode()).hexdigest().encode()
    return b"md5" + hashlib.md5(inner + salt).hexdigest().encode()


class Framer:
    """Follows message boundaries through a stream using only the 5-byte headers."""

    __slots__ = ("skip", "head", "last")

    def __init__(self) -> None:
        self.skip = 0  # bytes of the current message still to come
        self.head = b""  # a header split across chunks
        self.last = 0  # type byte of the last message started

    def feed(self, data: bytes) -> int:
        """The last message's type if ``data`` ends on a message boundary, else 0."""
        n, pos = len(data), self.skip
        if self.head:
            need = 5 - len(self.head)
            head = self.head + data[:need]
            if len(head) < 5:
                self.head = head
                return 0
            self.head, self.last = b"", head[0]
            pos = need + int.from_bytes(head[1:5], "big") - 4
        while pos + 5 <= n:
            self.last = data[pos]
            pos += 1 + int.from_bytes(data[pos + 1 : pos + 5], "big")
        if pos < n:
            self.head, self.skip = data[pos:], 0
            return 0
        self.skip = pos - n
        return self.last if pos == n else 0


class Pool:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.idle: list[Server] = []
        self.waiting: deque[Client] = deque()
        self.size = 0  # server connections open or opening
        self.params = b""  # ParameterStatus messages of the first server's greeting
        self.tasks: set[asyncio.Task[None]] = set()

    def acquire(self, client: Client) -> None:
        if self.idle:
            client.attach(self.idle.pop())
            return
        self.waiting.append(client)
        if self.size < self.args.pool_size:
            self.grow()

    def release(self, server: Server) -> None:
        while self.waiting:
            client = self.waiting.popleft()
            if not client.closed:
                client.attach(server)
                return
        self.idle.append(server)

    def grow(self) -> asyncio.Task[None]:
        """Open one more server connection (counted from now on) and hand it out."""
        self.size += 1
        task = asyncio.get_running_loop().create_task(self.open())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def shrink(self) -> None:
        """A server connection is gone: replace it if clients are waiting."""
        self.size -= 1
        if self.waiting and self.size < self.args.pool_size:
            self.grow()

    async def open(self) -> None:
        a, loop = self.args, asyncio.get_running_loop()
        try:
            _, server = await loop.create_connection(lambda: Server(self), a.pg_host, a.pg_port)
            await server.ready
        except OSError as exc:  # ConnectionError included: login failed
            print(f"floor_pooler: server connection failed: {exc}", file=sys.stderr, flush=True)
            while self.waiting:  # the first live waiter gives up, so nothing waits forever
                if not (client := self.waiting.popleft()).closed:
                    client.close()
                    break
            return self.shrink()
        if not server.transport.is_closing():  # else connection_lost shrinks the pool
            self.params = self.params or server.params
            self.release(server)


class Server(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool, self.client, self.framer = pool, None, Framer()
        self.ready = asyncio.get_running_loop().create_future()
        self.buf, self.params, self.scram, self.error = b"", b"", None, "connection lost"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        a = self.pool.args
        params = (
            f"user\0{a.user}\0database\0{a.dbname}\0application_name\0floor_pooler\0\0".encode()
        )
        transport.write(struct.pack("!II", len(params) + 8, PROTOCOL_3) + params)

    def data_received(self, data: bytes) -> None:
        if not self.ready.done():
            return self.login(data)
        kind = self.framer.feed(data)
        client = self.client
        if client is None:
            return  # e.g. a notice to an idle connection: nobody to tell
        client.transport.write(data)
        if kind == Z and data[-1] == IDLE:  # transaction over: back to the pool
            self.client = client.server = None
            self.pool.release(self)

    def login(self, data: bytes) -> None:
        a, self.buf = self.pool.args, self.buf + data
        while len(self.buf) >= 5:
            length = int.from_bytes(self.buf[1:5], "big")
            if len(self.buf) < length + 1:
                return
            kind, body, self.buf = self.buf[:1], self.buf[5 : length + 1], self.buf[length + 1 :]
            if kind == b"R":
                code = int.from_bytes(body[:4], "big")
                if code == 3:  # cleartext
                    self.transport.write(message(b"p", a.password.encode() + b"\0"))
                elif code == 5:  # md5
                    hashed = md5_password(a.user, a.password, body[4:8])
                    self.transport.write(message(b"p", hashed + b"\0"))
                elif code == 10:  # SASL: start SCRAM-SHA-256
                    self.scram = scramp.ScramClient(["SCRAM-SHA-256"], a.user, a.password)
                    first = self.scram.get_client_first().encode()
                    payload = b"SCRAM-SHA-256\0" + struct.pack("!I", len(first)) + first
                    self.transport.write(message(b"p", payload))
                elif code == 11:
                    self.scram.set_server_first(body[4:].decode())
                    self.transport.write(message(b"p", self.scram.get_client_final().encode()))
                elif code == 12:
                    self.scram.set_server_final(body[4:].decode())
                elif code != 0:
                    return self.abort(f"unsupported authentication request {code}")
            elif kind == b"S":
                self.params += message(kind, body)
            elif kind == b"E":
                return self.abort(body.replace(b"\0", b" ").decode(errors="replace"))
            elif kind == b"Z":
                self.ready.set_result(None)
                return

    def abort(self, error: str) -> None:
        self.error = error
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():  # open() reports it and shrinks the pool
            self.ready.set_exception(ConnectionError(self.error))
            return
        if self.client is not None:
            self.client.server = None  # do not close this connection again
            self.client.close()
        elif self in self.pool.idle:
            self.pool.idle.remove(self)
        self.pool.shrink()


class Client(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool, self.server, self.framer = pool, None, Framer()
        self.buf, self.pending, self.closed, self.authed = b"", [], False, False
        self.user, self.salt = "", os.urandom(4)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.authed:
            return self.handshake(data)
        if self.framer.feed(data) == X:  # Terminate: never forwarded
            return self.close()
        if self.server is not None:
            self.server.transport.write(data)
        else:
            self.pending.append(data)
            if len(self.pending) == 1:
                self.pool.acquire(self)

    def attach(self, server: Server) -> None:
        self.server, server.client = server, self
        data, self.pending = b"".join(self.pending), []
        server.transport.write(data)

    def handshake(self, data: bytes) -> None:
        self.buf += data
        while self.user == "" and len(self.buf) >= 8:  # startup packets: no type byte
            length, code = struct.unpack("!II", self.buf[:8])
            if len(self.buf) < length:
                return
            packet, self.buf = self.buf[8:length], self.buf[length:]
            if code in (SSL_REQUEST, GSSENC_REQUEST):
                self.transport.write(b"N")
            elif code == PROTOCOL_3:
                fields = packet.split(b"\0")
                params = dict(zip(fields[0::2], fields[1::2], strict=False))
                self.user = params.get(b"user", b"").decode() or "?"
                self.transport.write(message(b"R", struct.pack("!I", 5) + self.salt))
            else:  # CancelRequest and anything else
                return self.close()
        if self.user == "" or len(self.buf) < 5:
            return
        length = int.from_bytes(self.buf[1:5], "big")
        if len(self.buf) < length + 1:
            return
        answer, rest = self.buf[5 : length + 1].rstrip(b"\0"), self.buf[length + 1 :]
        a = self.pool.args
        if (
            self.buf[:1] != b"p"
            or self.user != a.user
            or answer != md5_password(a.user, a.password, self.salt)
        ):
            error = f'SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed for user "{self.user}"\0\0'
            self.transport.write(message(b"E", error.encode()))
            return self.close()
        self.authed, self.buf = True, b""
        key = message(b"K", struct.pack("!II", os.getpid(), id(self) & 0x7FFFFFFF))
        self.transport.write(
            message(b"R", b"\0\0\0\0") + self.pool.params + key + message(b"Z", b"I")
        )
        if rest:
            self.data_received(rest)

    def close(self) -> None:
        self.closed, self.pending = True, []  # from now on release() skips it
        server, self.server = self.server, None
        if server is not None:  # it is mid-transaction: the session cannot be reused
            server.client = None
            server.transport.close()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()


async def serve(args: argparse.Namespace) -> None:
    pool = Pool(args)
    await pool.grow()  # the first server connection: fail fast, and learn the parameters
    if not pool.idle:
        raise SystemExit(f"floor_pooler: cannot log in to {args.pg_host}:{args.pg_port}")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pool), args.listen_host, args.listen_port)
    for sock in server.sockets:
        if hasattr(socket, "TCP_DEFER_ACCEPT"):  # as PgBouncer and scry listen
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--pg-host", default="127.0.0.1")
    p.add_argument("--pg-port", type=int, default=5432)
    p.add_argument("--user", required=True)
    p.add_argument("--password", required=True)
    p.add_argument("--dbname", required=True)
    p.add_argument("--pool-size", type=int, default=20)
    uvloop.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
