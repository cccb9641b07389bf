"""Property tests for what the relay does with message *bodies* it did not write.

``tests/unit/test_framing.py`` already proves the framing layer: arbitrary
byte streams split at arbitrary points never crash ``MessageReader`` or
``MessageScanner``; they yield messages or a ``ProtocolViolation`` (08P01).
Framing-valid messages can still have nonsense bodies (a Bind without its
NUL terminators, an empty Describe). Under transaction and hybrid pooling
those bodies are read by the prepared-statement rewriter and by the relay's
statement-text helpers; here they must likewise either work or raise
``ProtocolViolation``, never anything else. Also: the reader and the scanner
agree on every stream.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry.client import parse_text
from scry.protocol.errors import ProtocolViolation
from scry.protocol.framing import MessageReader, MessageScanner
from scry.protocol.prepared import (
    ClientStatements,
    ParsedStatements,
    ServerStatements,
    answer_prepare,
    rewrite,
    server_name,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def frame(kind: int, body: bytes) -> bytes:
    return bytes((kind,)) + struct.pack("!I", len(body) + 4) + body


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    pieces, prev = [], 0
    for p in points:
        pieces.append(data[prev:p])
        prev = p
    pieces.append(data[prev:])
    return pieces


# Valid bodies to mix with the garbage, so that the rewriter gets into every state.
VALID = [
    (ord("P"), b"s1\x00select $1::int\x00\x00\x00"),
    (ord("P"), b"\x00select 1\x00\x00\x00"),
    (ord("B"), b"\x00s1\x00\x00\x00\x00\x01\x00\x00\x00\x011\x00\x00"),
    (ord("B"), b"p\x00\x00\x00\x00\x00\x00\x00\x00"),
    (ord("D"), b"Ss1\x00"),
    (ord("D"), b"P\x00"),
    (ord("C"), b"Ss1\x00"),
    (ord("E"), b"\x00\x00\x00\x00\x00"),
    (ord("S"), b""),
    (ord("H"), b""),
    (ord("Q"), b"select 1\x00"),
]
garbage_message = st.tuples(st.sampled_from(b"PBDCSEHQFdcf"), st.binary(max_size=24))
message_st = st.one_of(st.sampled_from(VALID), garbage_message)


@FUZZ
@given(batches=st.lists(st.lists(message_st, max_size=8), max_size=6))
def test_rewrite_never_crashes_on_bodies(batches: list[list[tuple[int, bytes]]]) -> None:
    client = ClientStatements()
    parsed = ParsedStatements(4)
    parsed.add(server_name(b"select $1::int\x00\x00\x00"))  # VALID's s1: answered by scry
    server = ServerStatements(4, parsed)
    for batch in batches:
        answer = answer_prepare(batch, client, parsed)
        if answer is not None:  # whole messages, and the last a ReadyForQuery
            reader = MessageReader()
            reader.feed(answer)
            assert reader.messages()[-1] == (ord("Z"), b"I")
            continue
        try:
            out = rewrite(batch, client, server)
        except ProtocolViolation as exc:
            assert exc.sqlstate == "08P01"
            return
        # Whatever it sends is a well-formed message stream.
        reader = MessageReader()
        reader.feed(out)
        reader.messages()
        assert reader.buffered == 0


@FUZZ
@given(body=st.binary(max_size=40))
def test_parse_text_never_crashes(body: bytes) -> None:
    text = parse_text(body)
    assert isinstance(text, bytes)


@FUZZ
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_reader_and_scanner_agree(data: bytes, cuts: list[int]) -> None:
    """Same stream, same chunks: both see the same messages, and fail at the same point."""
    want = frozenset(range(256))
    reader, scanner = MessageReader(), MessageScanner(want, max_collect=1 << 16)
    from_reader: list[tuple[int, bytes]] = []
    from_scanner: list[tuple[int, bytes]] = []
    reader_error = scanner_error = False
    for piece in split(data, cuts):
        if not reader_error:
            reader.feed(piece)
            try:
                from_reader.extend(reader.messages())
            except ProtocolViolation:
                reader_error = True
        if not scanner_error:
            try:
                _, events = scanner.feed(piece)
                from_scanner.extend((kind, body) for kind, _end, body in events)
            except ProtocolViolation:
                scanner_error = True
    # The scanner judges a header as soon as it is whole; the reader too: both
    # reject the same stream, and agree on every message before the bad one.
    assert reader_error == scanner_error
    if not reader_error:
        assert from_scanner == from_reader
    else:
        assert from_scanner[: len(from_reader)] == from_reader[: len(from_scanner)]
