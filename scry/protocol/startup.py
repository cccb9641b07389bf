"""The first packet of a connection: StartupMessage, SSLRequest, GSSENCRequest, CancelRequest.

These packets have no type byte: an int32 length (including itself), then an
int32 code. PostgreSQL caps them at 10,000 bytes; so do we.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from scry.protocol.errors import FEATURE_NOT_SUPPORTED, ProtocolViolation

MAX_STARTUP_PACKET = 10000
PROTOCOL_3_0 = 196608  # 3 << 16
PROTOCOL_OPTION_PREFIX = "_pq_."
SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104
CANCEL_REQUEST_CODE = 80877102

_HEAD = struct.Struct("!ii")


@dataclass(frozen=True, slots=True)
class StartupMessage:
    protocol: int
    params: dict[str, str] = field(default_factory=dict)

    @property
    def options(self) -> list[str]:
        """The protocol options asked for (``_pq_.name`` parameters): not settings."""
        return [name for name in self.params if name.startswith(PROTOCOL_OPTION_PREFIX)]

    @property
    def newer_than_spoken(self) -> bool:
        """Did the client ask for more than 3.0 (a later minor version, or options)?
        Then it must be told what we speak: NegotiateProtocolVersion."""
        return self.protocol != PROTOCOL_3_0 or any(
            name.startswith(PROTOCOL_OPTION_PREFIX) for name in self.params
        )

    @property
    def user(self) -> str:
        return self.params.get("user", "")

    @property
    def database(self) -> str:
        return self.params.get("database") or self.user


@dataclass(frozen=True, slots=True)
class SSLRequest:
    pass


@dataclass(frozen=True, slots=True)
class GSSENCRequest:
    pass


@dataclass(frozen=True, slots=True)
class CancelRequest:
    pid: int
    secret: int


StartupPacket = StartupMessage | SSLRequest | GSSENCRequest | CancelRequest


def read_startup_packet(buf: bytes | bytearray) -> tuple[StartupPacket, int] | None:
    """Parse one startup-phase packet from the front of ``buf``.

    Returns (packet, bytes consumed), or None if more bytes are needed.
    Raises ProtocolViolation for anything malformed.
    """
    if len(buf) < 8:
        return None
    length, code = _HEAD.unpack_from(buf)
    if length < 8 or length > MAX_STARTUP_PACKET:
        raise ProtocolViolation(f"invalid startup packet length {length}")
    if len(buf) < length:
        return None
    body = bytes(buf[8:length])
    if code == SSL_REQUEST_CODE and length == 8:
        return SSLRequest(), length
    if code == GSSENC_REQUEST_CODE and length == 8:
        return GSSENCRequest(), length
    if code == CANCEL_REQUEST_CODE and length == 16:
        pid, secret = struct.unpack("!iI", body)
        return CancelRequest(pid, secret), length
    if code >> 16 == 3:
        return StartupMessage(code, _parse_params(body)), length
    raise ProtocolViolation(
        f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: server supports 3.0",
        FEATURE_NOT_SUPPORTED,
    )


def _parse_params(body: bytes) -> dict[str, str]:
    # name NUL value NUL ... then one more NUL ends the list.
    if not (body == b"\x00" or body.endswith(b"\x00\x00")):
        raise ProtocolViolation("invalid startup packet layout: expected terminator as last byte")
    try:
        # Decoded whole, then split: a NUL byte is never part of a UTF-8 sequence.
        parts = body[:-2].decode().split("\x00") if len(body) > 1 else []
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("startup packet parameters are not valid UTF-8") from exc
    if len(parts) % 2:
        raise ProtocolViolation("startup packet has a parameter name without a value")
    names = parts[::2]
    if not all(names):
        raise ProtocolViolation("startup packet has an empty parameter name")
    params = dict(zip(names, parts[1::2], strict=True))
    if not params.get("user"):
        raise ProtocolViolation("no PostgreSQL user name specified in startup packet")
    return params


def startup_message(params: dict[str, str], protocol: int = PROTOCOL_3_0) -> bytes:
    """Build a StartupMessage (what the proxy sends to a backend)."""
    body = b"".join(k.encode() + b"\x00" + v.encode() + b"\x00" for k, v in params.items())
    body = struct.pack("!i", protocol) + body + b"\x00"
    return struct.pack("!i", len(body) + 4) + body


def ssl_request() -> bytes:
    return _HEAD.pack(8, SSL_REQUEST_CODE)


def cancel_request(pid: int, secret: int) -> bytes:
    return struct.pack("!iiiI", 16, CANCEL_REQUEST_CODE, pid, secret)
