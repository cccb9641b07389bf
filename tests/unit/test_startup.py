"""Unit tests for scry.protocol.startup: the untyped first packet of a connection."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.protocol.errors import ProtocolViolation
from scry.protocol.messages import negotiate_protocol_version
from scry.protocol.startup import (
    CANCEL_REQUEST_CODE,
    GSSENC_REQUEST_CODE,
    MAX_STARTUP_PACKET,
    PROTOCOL_3_0,
    SSL_REQUEST_CODE,
    CancelRequest,
    GSSENCRequest,
    SSLRequest,
    StartupMessage,
    cancel_request,
    read_startup_packet,
    ssl_request,
    startup_message,
)


def packet(code: int, body: bytes = b"") -> bytes:
    return struct.pack("!ii", len(body) + 8, code) + body


def params_body(*pairs: tuple[str, str]) -> bytes:
    return b"".join(k.encode() + b"\x00" + v.encode() + b"\x00" for k, v in pairs) + b"\x00"


def test_startup_message_params() -> None:
    data = packet(
        PROTOCOL_3_0,
        params_body(("user", "alice"), ("database", "shop"), ("application_name", "psql")),
    )
    pkt, used = read_startup_packet(data)  # type: ignore[misc]
    assert used == len(data)
    assert isinstance(pkt, StartupMessage)
    assert pkt.protocol == PROTOCOL_3_0
    assert pkt.params == {"user": "alice", "database": "shop", "application_name": "psql"}
    assert pkt.user == "alice"
    assert pkt.database == "shop"


@pytest.mark.parametrize(
    "pairs", [(("user", "bob"),), (("user", "bob"), ("database", ""))], ids=["absent", "empty"]
)
def test_database_defaults_to_user(pairs: tuple[tuple[str, str], ...]) -> None:
    pkt, _ = read_startup_packet(packet(PROTOCOL_3_0, params_body(*pairs)))  # type: ignore[misc]
    assert isinstance(pkt, StartupMessage)
    assert pkt.database == "bob"


@pytest.mark.parametrize(
    "body",
    [
        params_body(("database", "x")),
        params_body(("user", "")),
        b"\x00",
    ],
    ids=["missing", "empty", "no-params"],
)
def test_user_required(body: bytes) -> None:
    with pytest.raises(ProtocolViolation, match="user name") as ei:
        read_startup_packet(packet(PROTOCOL_3_0, body))
    assert ei.value.sqlstate == "08P01"


def test_odd_number_of_strings() -> None:
    body = b"user\x00alice\x00database\x00\x00"
    with pytest.raises(ProtocolViolation, match="without a value"):
        read_startup_packet(packet(PROTOCOL_3_0, body))


def test_not_nul_terminated() -> None:
    with pytest.raises(ProtocolViolation, match="terminator"):
        read_startup_packet(packet(PROTOCOL_3_0, b"user\x00alice"))


def test_missing_final_terminator_and_empty_name() -> None:
    with pytest.raises(ProtocolViolation, match="terminator"):
        read_startup_packet(packet(PROTOCOL_3_0, b"user\x00alice\x00"))
    with pytest.raises(ProtocolViolation, match="empty parameter name"):
        read_startup_packet(packet(PROTOCOL_3_0, b"\x00x\x00user\x00alice\x00\x00"))


def test_empty_body() -> None:
    with pytest.raises(ProtocolViolation):
        read_startup_packet(packet(PROTOCOL_3_0, b""))


def test_invalid_utf8() -> None:
    with pytest.raises(ProtocolViolation, match="UTF-8"):
        read_startup_packet(packet(PROTOCOL_3_0, b"user\x00\xff\xfe\x00\x00"))


def test_trailing_bytes_not_consumed() -> None:
    first = packet(PROTOCOL_3_0, params_body(("user", "u")))
    rest = b"p\x00\x00\x00\x09pass\x00"
    pkt, used = read_startup_packet(first + rest)  # type: ignore[misc]
    assert isinstance(pkt, StartupMessage)
    assert used == len(first)


def test_ssl_request() -> None:
    assert read_startup_packet(ssl_request()) == (SSLRequest(), 8)
    assert ssl_request() == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"


def test_gssenc_request() -> None:
    assert read_startup_packet(packet(GSSENC_REQUEST_CODE)) == (GSSENCRequest(), 8)


def test_ssl_request_followed_by_startup() -> None:
    startup = startup_message({"user": "u"})
    buf = bytearray(ssl_request() + startup)
    pkt, used = read_startup_packet(buf)  # type: ignore[misc]
    assert pkt == SSLRequest()
    del buf[:used]
    pkt, used = read_startup_packet(buf)  # type: ignore[misc]
    assert isinstance(pkt, StartupMessage) and pkt.user == "u"
    assert used == len(buf)


@pytest.mark.parametrize(("pid", "secret"), [(1234, 5678), (0x7FFFFFFF, 0xFFFFFFFF), (-1, 0)])
def test_cancel_request(pid: int, secret: int) -> None:
    data = cancel_request(pid, secret)
    assert len(data) == 16
    assert read_startup_packet(data) == (CancelRequest(pid, secret), 16)


def test_cancel_request_wrong_length_refused() -> None:
    with pytest.raises(ProtocolViolation):
        read_startup_packet(packet(CANCEL_REQUEST_CODE, b"\x00" * 12))


def test_ssl_request_with_body_refused() -> None:
    with pytest.raises(ProtocolViolation):
        read_startup_packet(packet(SSL_REQUEST_CODE, b"\x00" * 4))


@pytest.mark.parametrize("length", [-1, 0, 4, 7, MAX_STARTUP_PACKET + 1, 0x7FFFFFFF])
def test_bad_length_rejected_from_header(length: int) -> None:
    # Only the 8-byte head is given: a bad length is refused before waiting for more.
    with pytest.raises(ProtocolViolation) as ei:
        read_startup_packet(struct.pack("!ii", length, PROTOCOL_3_0))
    assert ei.value.sqlstate == "08P01"


def test_max_length_accepted() -> None:
    filler = "x" * (MAX_STARTUP_PACKET - 8 - len(b"user\x00u\x00a\x00\x00\x00"))
    data = packet(PROTOCOL_3_0, params_body(("user", "u"), ("a", filler)))
    assert len(data) == MAX_STARTUP_PACKET
    pkt, used = read_startup_packet(data)  # type: ignore[misc]
    assert used == MAX_STARTUP_PACKET
    assert isinstance(pkt, StartupMessage) and pkt.params["a"] == filler


@pytest.mark.parametrize("code", [2 << 16, (1 << 16) | 0, 4 << 16, 1234])
def test_other_protocols_refused(code: int) -> None:
    with pytest.raises(ProtocolViolation, match="unsupported frontend protocol"):
        read_startup_packet(packet(code, params_body(("user", "u"))))


def test_protocol_2_refused() -> None:
    with pytest.raises(ProtocolViolation, match=r"2\.0"):
        read_startup_packet(packet(2 << 16, params_body(("user", "u"))))


def test_partial_packets_return_none() -> None:
    data = startup_message({"user": "alice", "database": "db"})
    for i in range(len(data)):
        assert read_startup_packet(data[:i]) is None, i
    assert read_startup_packet(data) is not None
    for i in range(8):
        assert read_startup_packet(ssl_request()[:i]) is None
        assert read_startup_packet(cancel_request(1, 2)[:i]) is None
    assert read_startup_packet(cancel_request(1, 2)[:15]) is None


def test_startup_message_bytes() -> None:
    assert startup_message({"user": "u"}) == (b"\x00\x00\x00\x10\x00\x03\x00\x00user\x00u\x00\x00")


_name = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=12,
)
_value = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(user=_value.filter(bool), extra=st.dictionaries(_name, _value, max_size=6))
def test_startup_message_roundtrip(user: str, extra: dict[str, str]) -> None:
    params = {**extra, "user": user}
    data = startup_message(params)
    parsed = read_startup_packet(data)
    assert parsed is not None
    pkt, used = parsed
    assert used == len(data)
    assert pkt == StartupMessage(PROTOCOL_3_0, params)
    assert pkt.user == user


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_arbitrary_bytes_only_protocol_violation(data: bytes) -> None:
    try:
        result = read_startup_packet(data)
    except ProtocolViolation:
        return
    if result is not None:
        assert 8 <= result[1] <= len(data)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=64))
def test_arbitrary_startup_body_only_protocol_violation(body: bytes) -> None:
    try:
        result = read_startup_packet(packet(PROTOCOL_3_0, body))
    except ProtocolViolation:
        return
    assert result is not None
    pkt, _ = result
    assert isinstance(pkt, StartupMessage) and pkt.user


def test_protocol_3_2_and_options_ask_for_negotiation() -> None:
    def startup(protocol: int, **params: str) -> StartupMessage:
        body = struct.pack("!i", protocol)
        body += b"".join(k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items())
        packet, _ = read_startup_packet(struct.pack("!i", len(body) + 5) + body + b"\0")
        assert isinstance(packet, StartupMessage)
        return packet

    plain = startup(PROTOCOL_3_0, user="app")
    assert not plain.newer_than_spoken and plain.options == []
    newer = startup((3 << 16) | 2, user="app")
    assert newer.newer_than_spoken and newer.options == []
    options = startup(PROTOCOL_3_0, user="app", **{"_pq_.a": "1", "_pq_.b": "2"})
    assert options.newer_than_spoken and options.options == ["_pq_.a", "_pq_.b"]
    assert negotiate_protocol_version(0, options.options) == (
        b"v" + struct.pack("!iii", 4 + 8 + 14, 0, 2) + b"_pq_.a\0_pq_.b\0"
    )
