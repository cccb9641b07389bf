"""How the ``pgbouncer`` console answers: result sets, errors and values on the wire.

Every console answer is complete in one go: RowDescription, DataRows and
CommandComplete (or an ErrorResponse), then ReadyForQuery. Values are sent as
text, the way PgBouncer's console sends them; column types are the OIDs it
declares (text 25, int4 23, int8 20, numeric 1700). Also here: how rows
show connection ids, addresses and times.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

from scry.protocol import messages as m
from scry.protocol.errors import PROTOCOL_VIOLATION

TEXT, INT4, INT8, NUMERIC = 25, 23, 20, 1700
ADMIN_DB = "pgbouncer"
READY = m.ready_for_query()

Columns = Sequence[tuple[str, int]]


class ConsoleError(Exception):
    """A console command failed; the message is PgBouncer's."""


def error(text: str, sqlstate: str = PROTOCOL_VIOLATION) -> bytes:
    """An ErrorResponse (PgBouncer sends 08P01 for every console error)."""
    return m.error_response(sqlstate, text)


def result(columns: Columns, rows: Iterable[Sequence[Any]], tag: str) -> bytes:
    """A whole result set, ending in ReadyForQuery."""
    out = [m.row_description(columns)]
    out.extend(m.data_row(as_text(v) for v in row) for row in rows)
    out.append(m.command_complete(tag))
    out.append(READY)
    return b"".join(out)


def ok(tag: str) -> bytes:
    """CommandComplete ``tag`` and ReadyForQuery."""
    return m.command_complete(tag) + READY


def as_text(value: Any) -> str | None:
    """A value as PgBouncer prints it: NULL, 0/1 for booleans, whole numbers."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return str(int(value))
    return str(value)


def stamp(wall: float) -> str:
    """A timestamp as PgBouncer's console prints it."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(wall))


def num_id(ident: str) -> int:
    """The number in a connection id (``c12`` -> 12)."""
    digits = ident[1:]
    return int(digits) if digits.isascii() and digits.isdigit() else 0


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as (host, port); ("unix", 0) for a socket."""
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        return addr or "unix", 0
    return host.strip("[]"), int(port)


def fmt3(value: Any) -> str | None:
    """A number with three decimals (NULL stays NULL)."""
    return None if value is None else f"{float(value):.3f}"


def peer_uid(transport: asyncio.BaseTransport) -> tuple[int, int] | None:
    """(pid, uid) of the peer of a Unix socket, or None."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid
