"""Message builders and parsers for the PostgreSQL v3 protocol.

Builders return ready-to-send ``bytes``; parsers take a message *body* (the
bytes after the type byte and length) and return plain Python values. Only the
messages the proxy needs to understand are covered: the rest pass through as
opaque bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

_I32 = struct.Struct("!i")
_HEADER = struct.Struct("!cI")

# Backend (server -> client) message types.
AUTHENTICATION = b"R"
BACKEND_KEY_DATA = b"K"
BIND_COMPLETE = b"2"
CLOSE_COMPLETE = b"3"
COMMAND_COMPLETE = b"C"
COPY_DATA = b"d"
COPY_DONE = b"c"
COPY_IN_RESPONSE = b"G"
COPY_OUT_RESPONSE = b"H"
COPY_BOTH_RESPONSE = b"W"
DATA_ROW = b"D"
EMPTY_QUERY_RESPONSE = b"I"
ERROR_RESPONSE = b"E"
NEGOTIATE_PROTOCOL_VERSION = b"v"
NO_DATA = b"n"
NOTICE_RESPONSE = b"N"
NOTIFICATION_RESPONSE = b"A"
PARAMETER_DESCRIPTION = b"t"
PARAMETER_STATUS = b"S"
PARSE_COMPLETE = b"1"
PORTAL_SUSPENDED = b"s"
READY_FOR_QUERY = b"Z"
ROW_DESCRIPTION = b"T"

# Frontend (client -> server) message types.
BIND = b"B"
CLOSE = b"C"
COPY_FAIL = b"f"
DESCRIBE = b"D"
EXECUTE = b"E"
FLUSH = b"H"
FUNCTION_CALL = b"F"
PARSE = b"P"
PASSWORD = b"p"  # also SASLInitialResponse and SASLResponse
QUERY = b"Q"
SYNC = b"S"
TERMINATE = b"X"

# Authentication request codes (the first int32 of an 'R' message).
AUTH_OK = 0
AUTH_CLEARTEXT = 3
AUTH_MD5 = 5
AUTH_SASL = 10
AUTH_SASL_CONTINUE = 11
AUTH_SASL_FINAL = 12

# ReadyForQuery transaction status bytes.
TX_IDLE = ord("I")
TX_IN_BLOCK = ord("T")
TX_FAILED = ord("E")

# ErrorResponse / NoticeResponse field codes.
FIELD_SEVERITY = "S"
FIELD_SEVERITY_NONLOCALIZED = "V"
FIELD_SQLSTATE = "C"
FIELD_MESSAGE = "M"
FIELD_DETAIL = "D"
FIELD_HINT = "H"


def message(kind: bytes, body: bytes = b"") -> bytes:
    """Frame ``body`` as a typed message: type byte, int32 length, body."""
    return _HEADER.pack(kind, len(body) + 4) + body


def _cstr(value: str) -> bytes:
    return value.encode() + b"\x00"


# --- backend messages -------------------------------------------------------


def error_response(
    sqlstate: str,
    text: str,
    *,
    severity: str = "ERROR",
    detail: str | None = None,
    hint: str | None = None,
) -> bytes:
    """Build an ErrorResponse. ``severity`` is ERROR or FATAL (FATAL: we close next)."""
    return message(ERROR_RESPONSE, _notice_fields(severity, sqlstate, text, detail, hint))


def notice_response(
    text: str, *, sqlstate: str = "00000", severity: str = "NOTICE", detail: str | None = None
) -> bytes:
    """Build a NoticeResponse."""
    return message(NOTICE_RESPONSE, _notice_fields(severity, sqlstate, text, detail, None))


def _notice_fields(
    severity: str, sqlstate: str, text: str, detail: str | None, hint: str | None
) -> bytes:
    parts = [
        b"S" + _cstr(severity),
        b"V" + _cstr(severity),
        b"C" + _cstr(sqlstate),
        b"M" + _cstr(text),
    ]
    if detail:
        parts.append(b"D" + _cstr(detail))
    if hint:
        parts.append(b"H" + _cstr(hint))
    return b"".join(parts) + b"\x00"


def auth_ok() -> bytes:
    return message(AUTHENTICATION, _I32.pack(AUTH_OK))


def auth_cleartext_password() -> bytes:
    return message(AUTHENTICATION, _I32.pack(AUTH_CLEARTEXT))


def auth_md5_password(salt: bytes) -> bytes:
    return message(AUTHENTICATION, _I32.pack(AUTH_MD5) + salt)


def auth_sasl(mechanisms: Iterable[str]) -> bytes:
    body = _I32.pack(AUTH_SASL) + b"".join(_cstr(m) for m in mechanisms) + b"\x00"
    return message(AUTHENTICATION, body)


def auth_sasl_continue(data: bytes) -> bytes:
    return message(AUTHENTICATION, _I32.pack(AUTH_SASL_CONTINUE) + data)


def auth_sasl_final(data: bytes) -> bytes:
    return message(AUTHENTICATION, _I32.pack(AUTH_SASL_FINAL) + data)


def parameter_status(name: str, value: str) -> bytes:
    return message(PARAMETER_STATUS, _cstr(name) + _cstr(value))


def negotiate_protocol_version(newest_minor: int, unrecognized: Iterable[str]) -> bytes:
    """NegotiateProtocolVersion: the newest 3.x we speak, and the ``_pq_.``
    options of the StartupMessage we do not know."""
    names = list(unrecognized)
    body = struct.pack("!ii", newest_minor, len(names)) + b"".join(map(_cstr, names))
    return message(NEGOTIATE_PROTOCOL_VERSION, body)


def backend_key_data(pid: int, secret: int) -> bytes:
    return message(BACKEND_KEY_DATA, struct.pack("!iI", pid, secret))


def ready_for_query(status: int = TX_IDLE) -> bytes:
    return message(READY_FOR_QUERY, bytes((status,)))


def command_complete(tag: str) -> bytes:
    return message(COMMAND_COMPLETE, _cstr(tag))


def row_description(columns: Iterable[tuple[str, int]]) -> bytes:
    """RowDescription for text-format columns given as (name, type oid)."""
    cols = list(columns)
    body = [struct.pack("!h", len(cols))]
    for name, type_oid in cols:
        body.append(_cstr(name) + struct.pack("!ihihih", 0, 0, type_oid, -1, -1, 0))
    return message(ROW_DESCRIPTION, b"".join(body))


def _text_values(values: Iterable[str | None]) -> bytes:
    """An int16 count, then each value as int32 length + bytes (-1: NULL), as
    DataRow and Bind carry them."""
    vals = list(values)
    body = [struct.pack("!h", len(vals))]
    for v in vals:
        if v is None:
            body.append(_I32.pack(-1))
        else:
            raw = v.encode()
            body.append(_I32.pack(len(raw)) + raw)
    return b"".join(body)


def data_row(values: Iterable[str | None]) -> bytes:
    """DataRow with text-format values (None is SQL NULL)."""
    return message(DATA_ROW, _text_values(values))


# --- frontend messages --------------------------------------------------------


def query(sql: str) -> bytes:
    return message(QUERY, _cstr(sql))


def terminate() -> bytes:
    return message(TERMINATE)


def parameterized_query(sql: str, params: Iterable[str | None]) -> bytes:
    """Parse, Bind, Execute and Sync of the unnamed statement: ``sql`` with
    text parameters ($1, ...) that never become part of its text."""
    # Bind: unnamed portal and statement, no parameter formats (text), the
    # values, no result formats (text).
    bind = b"\x00\x00\x00\x00" + _text_values(params) + b"\x00\x00"
    return (
        message(PARSE, b"\x00" + _cstr(sql) + struct.pack("!h", 0))
        + message(BIND, bind)
        + message(EXECUTE, b"\x00" + _I32.pack(0))
        + message(SYNC)
    )


def sync() -> bytes:
    return message(SYNC)


def password_message(password: bytes) -> bytes:
    return message(PASSWORD, password + b"\x00")


def sasl_initial_response(mechanism: str, data: bytes) -> bytes:
    return message(PASSWORD, _cstr(mechanism) + _I32.pack(len(data)) + data)


def sasl_response(data: bytes) -> bytes:
    return message(PASSWORD, data)


# --- parsers --------------------------------------------------------------------


def parse_data_row(body: bytes) -> list[bytes | None]:
    """The column values of a DataRow body (None is SQL NULL)."""
    (count,) = struct.unpack_from("!h", body)
    values: list[bytes | None] = []
    pos = 2
    for _ in range(count):
        (length,) = _I32.unpack_from(body, pos)
        pos += 4
        if length < 0:
            values.append(None)
        else:
            values.append(body[pos : pos + length])
            pos += length
    return values


def parse_row_description(body: bytes) -> list[tuple[str, int]]:
    """The (name, type oid) of each column of a RowDescription body."""
    (count,) = struct.unpack_from("!h", body)
    columns = []
    pos = 2
    for _ in range(count):
        stop = body.index(b"\x00", pos)
        name = body[pos:stop].decode(errors="replace")
        (type_oid,) = _I32.unpack_from(body, stop + 7)  # after table oid (4), column (2)
        columns.append((name, type_oid))
        pos = stop + 19  # NUL, table oid, column, type oid, size (2), modifier (4), format (2)
    return columns


def parse_fields(body: bytes) -> dict[str, str]:
    """Fields of an ErrorResponse/NoticeResponse body, by one-letter code."""
    fields: dict[str, str] = {}
    pos = 0
    end = len(body)
    while pos < end and body[pos] != 0:
        code = chr(body[pos])
        stop = body.index(b"\x00", pos + 1)
        fields[code] = body[pos + 1 : stop].decode(errors="replace")
        pos = stop + 1
    return fields


def parse_cstrings(body: bytes) -> list[str]:
    """Split a body made of NUL-terminated strings (ParameterStatus, Query)."""
    return [s.decode(errors="replace") for s in body.split(b"\x00")[:-1]]


def parse_parameter_status(body: bytes) -> tuple[str, str]:
    name, value = parse_cstrings(body)[:2]
    return name, value


def parse_query_text(body: bytes | memoryview) -> str:
    """The SQL text of a Query ('Q') body."""
    raw = bytes(body)
    nul = raw.find(b"\x00")
    return raw[: nul if nul >= 0 else len(raw)].decode(errors="replace")


def parse_command_rows(tag: bytes) -> int:
    """Row count from a CommandComplete tag ("SELECT 5", "INSERT 0 3"); 0 if none."""
    last = tag.rstrip(b"\x00").rpartition(b" ")[2]
    return int(last) if last.isdigit() else 0


def parse_auth_request(body: bytes) -> tuple[int, bytes]:
    """Split an Authentication ('R') body into (code, rest)."""
    return _I32.unpack_from(body)[0], body[4:]


def parse_sasl_mechanisms(data: bytes) -> list[str]:
    return [m for m in parse_cstrings(data) if m]


def parse_sasl_initial_response(body: bytes) -> tuple[str, bytes]:
    """(mechanism, client-first data) from a SASLInitialResponse body."""
    nul = body.index(b"\x00")
    mechanism = body[:nul].decode()
    if len(body) < nul + 5:
        raise ValueError("SASLInitialResponse is truncated")
    (length,) = _I32.unpack_from(body, nul + 1)
    data = b"" if length < 0 else body[nul + 5 : nul + 5 + length]
    return mechanism, data


def encode_parameters(params: Mapping[str, str]) -> bytes:
    return b"".join(_cstr(k) + _cstr(v) for k, v in params.items())
