"""Unit tests for scry.protocol.messages: builders and parsers."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.protocol import messages as m
from scry.protocol.framing import MessageReader


def one(data: bytes) -> tuple[int, bytes]:
    """Parse exactly one framed message from ``data``."""
    r = MessageReader()
    r.feed(data)
    msgs = r.messages()
    assert len(msgs) == 1 and r.buffered == 0
    return msgs[0]


def test_message_framing() -> None:
    assert m.message(b"S") == b"S\x00\x00\x00\x04"
    assert m.message(b"Q", b"abc") == b"Q\x00\x00\x00\x07abc"


def test_error_response_fields_roundtrip() -> None:
    kind, body = one(
        m.error_response("28P01", "bad password", severity="FATAL", detail="d", hint="h")
    )
    assert kind == ord("E")
    assert body.endswith(b"\x00\x00")
    assert m.parse_fields(body) == {
        "S": "FATAL",
        "V": "FATAL",
        "C": "28P01",
        "M": "bad password",
        "D": "d",
        "H": "h",
    }


def test_error_response_defaults_omit_detail_and_hint() -> None:
    _, body = one(m.error_response("08P01", "oops"))
    assert m.parse_fields(body) == {"S": "ERROR", "V": "ERROR", "C": "08P01", "M": "oops"}


def test_notice_response() -> None:
    kind, body = one(m.notice_response("hello", detail="more"))
    assert kind == ord("N")
    fields = m.parse_fields(body)
    assert fields[m.FIELD_SEVERITY] == "NOTICE"
    assert fields[m.FIELD_SQLSTATE] == "00000"
    assert fields[m.FIELD_MESSAGE] == "hello"
    assert fields[m.FIELD_DETAIL] == "more"


_text = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    sqlstate=st.text(alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=5, max_size=5),
    text=_text,
    severity=st.sampled_from(["ERROR", "FATAL", "PANIC"]),
    detail=st.none() | _text.filter(bool),
    hint=st.none() | _text.filter(bool),
)
def test_error_response_roundtrip_property(
    sqlstate: str, text: str, severity: str, detail: str | None, hint: str | None
) -> None:
    _, body = one(m.error_response(sqlstate, text, severity=severity, detail=detail, hint=hint))
    expected = {"S": severity, "V": severity, "C": sqlstate, "M": text}
    if detail:
        expected["D"] = detail
    if hint:
        expected["H"] = hint
    assert m.parse_fields(body) == expected


def test_parse_fields_stops_at_terminator() -> None:
    assert m.parse_fields(b"Cxx\x00\x00Mignored\x00") == {"C": "xx"}
    assert m.parse_fields(b"\x00") == {}
    assert m.parse_fields(b"") == {}


def test_parameter_status() -> None:
    kind, body = one(m.parameter_status("TimeZone", "Europe/Paris"))
    assert kind == ord("S")
    assert body == b"TimeZone\x00Europe/Paris\x00"
    assert m.parse_parameter_status(body) == ("TimeZone", "Europe/Paris")
    assert m.parse_parameter_status(one(m.parameter_status("x", ""))[1]) == ("x", "")


@pytest.mark.parametrize(
    ("tag", "rows"),
    [
        (b"SELECT 5", 5),
        (b"SELECT 5\x00", 5),
        (b"INSERT 0 3", 3),
        (b"INSERT 0 3\x00", 3),
        (b"UPDATE 12", 12),
        (b"DELETE 0", 0),
        (b"COPY 7\x00", 7),
        (b"BEGIN", 0),
        (b"BEGIN\x00", 0),
        (b"CREATE TABLE", 0),
        (b"", 0),
    ],
)
def test_parse_command_rows(tag: bytes, rows: int) -> None:
    assert m.parse_command_rows(tag) == rows


def test_command_complete_body_parses() -> None:
    kind, body = one(m.command_complete("INSERT 0 3"))
    assert kind == ord("C")
    assert m.parse_command_rows(body) == 3


def test_row_description_shape() -> None:
    kind, body = one(m.row_description([("name", 25), ("n", 23)]))
    assert kind == ord("T")
    (count,) = struct.unpack_from("!h", body)
    assert count == 2
    pos = 2
    cols = []
    for _ in range(count):
        nul = body.index(b"\x00", pos)
        name = body[pos:nul].decode()
        table_oid, attnum, type_oid, typlen, typmod, fmt = struct.unpack_from(
            "!ihihih", body, nul + 1
        )
        cols.append((name, table_oid, attnum, type_oid, typlen, typmod, fmt))
        pos = nul + 1 + 18
    assert pos == len(body)
    assert cols == [("name", 0, 0, 25, -1, -1, 0), ("n", 0, 0, 23, -1, -1, 0)]


def test_parse_row_description() -> None:
    _kind, body = one(m.row_description([("name", 25), ("n", 23)]))
    assert m.parse_row_description(body) == [("name", 25), ("n", 23)]
    # As PostgreSQL sends one: a table's column, its size and modifier set.
    column = b"id\x00" + struct.pack("!ihihih", 16384, 2, 20, 8, -1, 1)
    assert m.parse_row_description(struct.pack("!h", 2) + column * 2) == [("id", 20)] * 2
    assert m.parse_row_description(b"\x00\x00") == []


def test_row_description_empty() -> None:
    assert one(m.row_description([])) == (ord("T"), b"\x00\x00")


def test_data_row_shape() -> None:
    kind, body = one(m.data_row(["abc", None, "", "é"]))
    assert kind == ord("D")
    (count,) = struct.unpack_from("!h", body)
    assert count == 4
    pos = 2
    values: list[bytes | None] = []
    for _ in range(count):
        (n,) = struct.unpack_from("!i", body, pos)
        pos += 4
        if n == -1:
            values.append(None)
        else:
            values.append(body[pos : pos + n])
            pos += n
    assert pos == len(body)
    assert values == [b"abc", None, b"", "é".encode()]


def test_ready_for_query_and_key_data() -> None:
    assert one(m.ready_for_query()) == (ord("Z"), b"I")
    assert one(m.ready_for_query(m.TX_IN_BLOCK)) == (ord("Z"), b"T")
    assert one(m.backend_key_data(42, 0xFFFFFFFF)) == (
        ord("K"),
        struct.pack("!iI", 42, 0xFFFFFFFF),
    )


def test_frontend_messages() -> None:
    kind, body = one(m.query("select 1"))
    assert kind == ord("Q") and m.parse_query_text(body) == "select 1"
    assert m.parse_query_text(memoryview(b"abc")) == "abc"  # tolerates a missing NUL
    assert one(m.sync()) == (ord("S"), b"")
    assert one(m.terminate()) == (ord("X"), b"")
    assert one(m.password_message(b"pw")) == (ord("p"), b"pw\x00")
    assert one(m.sasl_response(b"c=biws")) == (ord("p"), b"c=biws")


def test_parameterized_query_and_data_rows() -> None:
    r = MessageReader()
    r.feed(m.parameterized_query("SELECT $1, $2", ["o'hara", None]))
    (pk, parse), (bk, bind), (ek, execute), (sk, sync) = r.messages()
    assert (pk, ek, sk, sync) == (ord("P"), ord("E"), ord("S"), b"")
    assert parse == b"\x00SELECT $1, $2\x00\x00\x00"  # unnamed, no parameter types
    # portal, statement, no formats, 2 values (the quote goes as is; NULL is -1), text results
    assert bind == b"\x00\x00" + struct.pack("!hh", 0, 2) + struct.pack("!i", 6) + b"o'hara" + (
        struct.pack("!ih", -1, 0)
    )
    assert execute == b"\x00" + struct.pack("!i", 0)
    _, row = one(m.data_row(["a", None, ""]))
    assert m.parse_data_row(row) == [b"a", None, b""]


def test_sasl_initial_response_roundtrip() -> None:
    kind, body = one(m.sasl_initial_response("SCRAM-SHA-256", b"n,,n=,r=abc"))
    assert kind == ord("p")
    assert m.parse_sasl_initial_response(body) == ("SCRAM-SHA-256", b"n,,n=,r=abc")
    # a length of -1 means "no initial response"
    assert m.parse_sasl_initial_response(b"SCRAM-SHA-256\x00\xff\xff\xff\xff") == (
        "SCRAM-SHA-256",
        b"",
    )


def test_auth_requests() -> None:
    cases = [
        (m.auth_ok(), m.AUTH_OK, b""),
        (m.auth_cleartext_password(), m.AUTH_CLEARTEXT, b""),
        (m.auth_md5_password(b"salt"), m.AUTH_MD5, b"salt"),
        (m.auth_sasl_continue(b"r=x"), m.AUTH_SASL_CONTINUE, b"r=x"),
        (m.auth_sasl_final(b"v=y"), m.AUTH_SASL_FINAL, b"v=y"),
    ]
    for data, code, rest in cases:
        kind, body = one(data)
        assert kind == ord("R")
        assert m.parse_auth_request(body) == (code, rest)


def test_auth_sasl_mechanisms() -> None:
    _, body = one(m.auth_sasl(["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]))
    code, rest = m.parse_auth_request(body)
    assert code == m.AUTH_SASL
    assert rest == b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00\x00"
    assert m.parse_sasl_mechanisms(rest) == ["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]


def test_encode_parameters_and_parse_cstrings() -> None:
    raw = m.encode_parameters({"a": "1", "b": ""})
    assert raw == b"a\x001\x00b\x00\x00"
    assert m.parse_cstrings(raw) == ["a", "1", "b", ""]
