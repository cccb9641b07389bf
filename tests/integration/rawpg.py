"""A tiny blocking PostgreSQL protocol-3 client for wire tests (trust auth).

Message builders, a raw client that reads whole messages, and helpers to
look at what came back; shared by the wire tests that need exact bytes.
"""

from __future__ import annotations

import socket
import struct

PROTOCOL_3 = 196608


def msg(kind: bytes, body: bytes = b"") -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def cstr(text: str | bytes) -> bytes:
    return (text.encode() if isinstance(text, str) else text) + b"\0"


def q(sql: str) -> bytes:
    return msg(b"Q", cstr(sql))


def parse(sql: str, name: str = "", types: tuple[int, ...] = ()) -> bytes:
    body = cstr(name) + cstr(sql) + struct.pack("!h", len(types))
    body += b"".join(struct.pack("!i", t) for t in types)
    return msg(b"P", body)


def bind(params: tuple[str | None, ...] = (), stmt: str = "", portal: str = "") -> bytes:
    body = cstr(portal) + cstr(stmt) + struct.pack("!hh", 0, len(params))
    for p in params:
        if p is None:
            body += struct.pack("!i", -1)
        else:
            data = p.encode()
            body += struct.pack("!i", len(data)) + data
    return msg(b"B", body + struct.pack("!h", 0))


def describe(kind: bytes, name: str = "") -> bytes:
    return msg(b"D", kind + cstr(name))


def execute(portal: str = "", max_rows: int = 0) -> bytes:
    return msg(b"E", cstr(portal) + struct.pack("!i", max_rows))


def close(kind: bytes, name: str) -> bytes:
    return msg(b"C", kind + cstr(name))


SYNC = msg(b"S")
FLUSH = msg(b"H")
TERMINATE = msg(b"X")


def fields(body: bytes) -> dict[str, str]:
    return {chr(p[0]): p[1:].decode(errors="replace") for p in body.split(b"\0") if p}


def data_row(body: bytes) -> list[str | None]:
    (n,) = struct.unpack_from("!h", body)
    pos, out = 2, []
    for _ in range(n):
        (length,) = struct.unpack_from("!i", body, pos)
        pos += 4
        if length < 0:
            out.append(None)
        else:
            out.append(body[pos : pos + length].decode())
            pos += length
    return out


class Raw:
    """A blocking protocol-3 client for a trust-auth proxy."""

    def __init__(
        self,
        port: int,
        user: str = "app",
        database: str = "app",
        *,
        protocol: int = PROTOCOL_3,
        params: dict[str, str] | None = None,
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.buf = b""
        body = struct.pack("!i", protocol) + cstr("user") + cstr(user)
        body += cstr("database") + cstr(database)
        body += b"".join(cstr(k) + cstr(v) for k, v in (params or {}).items()) + b"\0"
        self.sock.sendall(struct.pack("!i", len(body) + 4) + body)
        login = self.login = self.until_ready()
        errors = [fields(b) for k, b in login if k == "E"]
        assert not errors, errors
        key = [b for k, b in login if k == "K"]
        self.key = struct.unpack("!iI", key[0]) if key else None

    def send(self, *parts: bytes) -> None:
        self.sock.sendall(b"".join(parts))

    def recv(self) -> tuple[str, bytes]:
        while True:
            if len(self.buf) >= 5:
                (length,) = struct.unpack_from("!i", self.buf, 1)
                if len(self.buf) >= 1 + length:
                    kind, body = chr(self.buf[0]), self.buf[5 : 1 + length]
                    self.buf = self.buf[1 + length :]
                    return kind, body
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"connection closed; buffered {self.buf!r}")
            self.buf += chunk

    def until(self, kind: str) -> list[tuple[str, bytes]]:
        out = []
        while True:
            item = self.recv()
            out.append(item)
            if item[0] == kind:
                return out

    def until_ready(self) -> list[tuple[str, bytes]]:
        return self.until("Z")

    def nothing_extra(self) -> None:
        """No stray message (such as a second ReadyForQuery) follows: the answer
        to a sentinel query comes next, and nothing else."""
        self.send(q("select 'sentinel'"))
        got = self.until_ready()
        assert kinds(got) == "TDCZ", f"unexpected messages before the sentinel's answer: {got}"

    def close(self) -> None:
        try:
            self.sock.sendall(TERMINATE)
        except OSError:
            pass
        self.sock.close()

    def vanish(self) -> None:
        """Close abruptly (RST), mid-whatever."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def kinds(messages: list[tuple[str, bytes]]) -> str:
    return "".join(k for k, _ in messages)


def copy_data(data: bytes) -> bytes:
    return msg(b"d", data)


def copy_fail(reason: str) -> bytes:
    return msg(b"f", cstr(reason))


COPY_DONE = msg(b"c")
