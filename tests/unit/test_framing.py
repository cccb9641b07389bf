"""Unit tests for scry.protocol.framing: MessageReader and MessageScanner.

Pure and fast: bytes in, messages/events out, no sockets. The property tests
split valid (and arbitrary) streams at arbitrary points and check that the
result never depends on where the chunk boundaries fall.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry.protocol import framing
from scry.protocol.errors import PROTOCOL_VIOLATION, ProtocolViolation
from scry.protocol.framing import (
    DEFAULT_MAX_COLLECT,
    DEFAULT_MAX_MESSAGE_SIZE,
    MessageReader,
    MessageScanner,
    PyMessageScanner,
)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WANT = frozenset(b"QSZ")  # a few "interesting" types; others pass through untouched
KINDS = b"QSZDTCEXdp"  # wanted and unwanted message types


def frame(kind: int, body: bytes) -> bytes:
    return bytes((kind,)) + struct.pack("!I", len(body) + 4) + body


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (clamped, deduplicated, may yield empty pieces)."""
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    pieces = []
    prev = 0
    for p in points:
        pieces.append(data[prev:p])
        prev = p
    pieces.append(data[prev:])
    return pieces


messages_st = st.lists(
    st.tuples(st.sampled_from(KINDS), st.binary(max_size=40)),
    max_size=12,
)
cuts_st = st.lists(st.integers(min_value=0, max_value=600), max_size=20)


# --- MessageReader ---------------------------------------------------------------


def test_reader_single_message() -> None:
    r = MessageReader()
    r.feed(frame(ord("Q"), b"select 1\x00"))
    assert r.next_message() == (ord("Q"), b"select 1\x00")
    assert r.next_message() is None
    assert r.buffered == 0


def test_reader_waits_for_header_and_body() -> None:
    r = MessageReader()
    data = frame(ord("p"), b"secret\x00")
    for i in range(len(data) - 1):
        r.feed(data[i : i + 1])
        assert r.next_message() is None
    r.feed(data[-1:])
    assert r.next_message() == (ord("p"), b"secret\x00")


def test_reader_empty_body_and_take_remaining() -> None:
    r = MessageReader()
    r.feed(frame(ord("S"), b"") + frame(ord("X"), b"") + b"Q\x00\x00")
    assert r.messages() == [(ord("S"), b""), (ord("X"), b"")]
    assert r.buffered == 3
    assert r.take_remaining() == b"Q\x00\x00"
    assert r.buffered == 0
    assert r.messages() == []


@FUZZ
@given(msgs=messages_st, cuts=cuts_st)
def test_reader_any_split(msgs: list[tuple[int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(frame(k, b) for k, b in msgs)
    r = MessageReader()
    got: list[tuple[int, bytes]] = []
    for piece in split(stream, cuts):
        r.feed(piece)
        got.extend(r.messages())
    assert got == list(msgs)
    assert r.buffered == 0


@pytest.mark.parametrize("length", [0x7FFFFFFF, 0xFFFFFFFF, DEFAULT_MAX_MESSAGE_SIZE + 5])
def test_reader_oversized_length_rejected_from_header(length: int) -> None:
    r = MessageReader()
    r.feed(b"Q" + struct.pack("!I", length))  # only the header: no body buffered yet
    with pytest.raises(ProtocolViolation) as ei:
        r.next_message()
    assert ei.value.sqlstate == PROTOCOL_VIOLATION == "08P01"


def test_reader_length_at_limit_accepted() -> None:
    r = MessageReader(max_message_size=8)
    r.feed(frame(ord("d"), b"12345678"))
    assert r.next_message() == (ord("d"), b"12345678")
    r.feed(frame(ord("d"), b"123456789"))
    with pytest.raises(ProtocolViolation):
        r.next_message()


@pytest.mark.parametrize("length", [0, 1, 2, 3])
def test_reader_length_below_four_rejected(length: int) -> None:
    r = MessageReader()
    r.feed(b"Q" + struct.pack("!I", length))
    with pytest.raises(ProtocolViolation) as ei:
        r.next_message()
    assert ei.value.sqlstate == "08P01"


# --- MessageScanner: examples -------------------------------------------------------


def test_scanner_whole_chunk() -> None:
    s = MessageScanner([b"Q", b"Z"])
    data = frame(ord("D"), b"row") + frame(ord("Z"), b"I") + frame(ord("C"), b"x\x00")
    out, events = s.feed(data)
    assert out == data
    assert events == [(ord("Z"), 14, b"I")]
    assert s.at_boundary


def test_scanner_accepts_int_and_bytes_wants() -> None:
    s = MessageScanner([ord("Q"), b"S"])
    data = frame(ord("Q"), b"q\x00") + frame(ord("S"), b"")
    _, events = s.feed(data)
    assert [e[0] for e in events] == [ord("Q"), ord("S")]


def test_scanner_tables_follow_what_each_scanner_wants() -> None:
    # The compiled scanner finds the tables of constant tuples by identity:
    # each scanner must still report its own kinds, however often it is made.
    data = frame(ord("Q"), b"q\x00") + frame(ord("Z"), b"I") + frame(ord("S"), b"")
    wants = [(b"Q",), (b"Z",), (b"Q",), [b"S"], (b"Z", b"S"), (b"Z",)]
    for _ in range(3):
        for want in wants:
            _, events = MessageScanner(want).feed(data)
            assert [bytes([e[0]]) for e in events] == [k for k in (b"Q", b"Z", b"S") if k in want]
        _, events = MessageScanner((b"Q",), mark=(b"S",)).feed(data)
        assert events == [(ord("Q"), 7, b"q\x00"), (ord("S"), 18, b"")]


def test_scanner_holds_back_partial_header() -> None:
    s = MessageScanner([b"Z"])
    msg = frame(ord("Z"), b"I")
    out, events = s.feed(frame(ord("D"), b"abc") + msg[:3])
    assert out == frame(ord("D"), b"abc")  # never forwards a chunk ending inside a header
    assert events == []
    assert not s.at_boundary
    out, events = s.feed(msg[3:])
    assert out == msg
    assert events == [(ord("Z"), len(msg), b"I")]
    assert s.at_boundary


def test_scanner_empty_feed() -> None:
    s = MessageScanner([b"Z"])
    assert s.feed(b"") == (b"", [])
    assert s.at_boundary
    s.feed(b"Z\x00")
    assert s.feed(b"") == (b"", [])
    assert not s.at_boundary


def test_scanner_body_spans_chunks() -> None:
    s = MessageScanner([b"Q"])
    body = b"select " + b"x" * 100 + b"\x00"
    msg = frame(ord("Q"), body)
    out1, ev1 = s.feed(msg[:20])
    assert out1 == msg[:20] and ev1 == []
    assert not s.at_boundary
    out2, ev2 = s.feed(msg[20:60])
    assert out2 == msg[20:60] and ev2 == []
    tail = frame(ord("S"), b"")
    out3, ev3 = s.feed(msg[60:] + tail)
    assert out3 == msg[60:] + tail
    assert ev3 == [(ord("Q"), len(msg) - 60, body)]
    assert s.at_boundary


def test_scanner_unwanted_body_spanning_chunks_not_collected() -> None:
    s = MessageScanner([b"Z"])
    msg = frame(ord("d"), b"y" * 1000)
    assert s.feed(msg[:10]) == (msg[:10], [])
    assert s._collect is None  # nothing gathered for an unwanted message
    assert s.feed(msg[10:]) == (msg[10:], [])
    assert s.at_boundary


# --- MessageScanner: properties ------------------------------------------------------


def scan_all(
    scanner: MessageScanner, pieces: list[bytes]
) -> tuple[list[bytes], list[tuple[int, int, bytes]], list[tuple[int, bool]]]:
    """Feed pieces; return forwarded chunks, events with *global* end offsets,
    and (bytes fed so far, at_boundary) after each feed."""
    forwarded: list[bytes] = []
    events: list[tuple[int, int, bytes]] = []
    boundary: list[tuple[int, bool]] = []
    base = 0
    fed = 0
    for piece in pieces:
        out, evs = scanner.feed(piece)
        fed += len(piece)
        last_end = -1
        for kind, end, body in evs:
            # offsets are within the chunk returned by this very call, increasing
            assert 0 < end <= len(out)
            assert end > last_end
            last_end = end
            events.append((kind, base + end, body))
        forwarded.append(out)
        base += len(out)
        boundary.append((fed, scanner.at_boundary))
    return forwarded, events, boundary


@FUZZ
@given(msgs=messages_st, cuts=cuts_st)
def test_scanner_any_split(msgs: list[tuple[int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(frame(k, b) for k, b in msgs)
    ends = []
    header_inner = set()  # offsets strictly inside a header (a forwarded chunk must not end there)
    pos = 0
    for _k, b in msgs:
        header_inner.update(range(pos + 1, pos + 5))
        pos += 5 + len(b)
        ends.append(pos)
    boundaries = {0, *ends}
    expected = [(k, end, b) for (k, b), end in zip(msgs, ends, strict=True) if k in WANT]

    forwarded, events, boundary = scan_all(MessageScanner(WANT), split(stream, cuts))

    assert b"".join(forwarded) == stream
    assert events == expected
    for fed, at in boundary:
        assert at == (fed in boundaries), fed
    offset = 0
    for chunk in forwarded:
        offset += len(chunk)
        assert offset not in header_inner


@FUZZ
@given(msgs=messages_st, cuts=cuts_st, max_collect=st.integers(min_value=0, max_value=50))
def test_scanner_bodies_gathered_across_chunks_are_truncated(
    msgs: list[tuple[int, bytes]], cuts: list[int], max_collect: int
) -> None:
    """A wanted body gathered across several chunks is cut to ``max_collect`` bytes;
    the forwarded stream is never affected by the truncation."""
    stream = b"".join(frame(k, b) for k, b in msgs)
    forwarded, events, _ = scan_all(
        MessageScanner(WANT, max_collect=max_collect), split(stream, cuts)
    )
    assert b"".join(forwarded) == stream
    wanted = [(k, b) for k, b in msgs if k in WANT]
    assert [e[0] for e in events] == [k for k, _ in wanted]
    for (_, _, got), (_, body) in zip(events, wanted, strict=True):
        # Either the whole body (message inside one chunk) or its first max_collect bytes.
        assert got == body or got == body[:max_collect]


def test_scanner_max_collect_truncates_spanning_body() -> None:
    s = MessageScanner([b"Q"], max_collect=10)
    body = bytes(range(100))
    msg = frame(ord("Q"), body)
    s.feed(msg[:30])
    s.feed(msg[30:70])
    _, events = s.feed(msg[70:])
    assert events == [(ord("Q"), len(msg) - 70, body[:10])]


def test_scanner_default_max_collect_keeps_whole_body() -> None:
    s = MessageScanner([b"Q"])
    body = b"x" * 5000
    msg = frame(ord("Q"), body)
    s.feed(msg[:7])
    _, events = s.feed(msg[7:])
    assert events[0][2] == body
    assert len(body) < DEFAULT_MAX_COLLECT


def test_scanner_max_collect_independent_of_split() -> None:
    body = bytes(range(100))
    msg = frame(ord("Q"), body)
    whole = MessageScanner([b"Q"], max_collect=10).feed(msg)[1]
    s = MessageScanner([b"Q"], max_collect=10)
    s.feed(msg[:50])
    spanning = s.feed(msg[50:])[1]
    assert whole[0][2] == spanning[0][2] == body[:10]


@pytest.mark.parametrize("length", [0x7FFFFFFF, 0xFFFFFFFF, DEFAULT_MAX_MESSAGE_SIZE + 5])
def test_scanner_oversized_length_rejected_from_header(length: int) -> None:
    s = MessageScanner([b"Q"])
    with pytest.raises(ProtocolViolation) as ei:
        s.feed(b"Q" + struct.pack("!I", length))
    assert ei.value.sqlstate == "08P01"
    assert s._remaining == 0 and s._collect is None  # nothing set up to buffer


def test_scanner_oversized_length_after_valid_messages() -> None:
    s = MessageScanner([b"Q"], max_message_size=16)
    with pytest.raises(ProtocolViolation):
        s.feed(frame(ord("S"), b"") + b"d" + struct.pack("!I", 4 + 17))


def test_scanner_oversized_length_with_header_split() -> None:
    s = MessageScanner([b"Q"])
    header = b"Q" + struct.pack("!I", 0x7FFFFFFF)
    assert s.feed(header[:3]) == (b"", [])
    with pytest.raises(ProtocolViolation):
        s.feed(header[3:])


@pytest.mark.parametrize("length", [0, 1, 2, 3])
def test_scanner_length_below_four_rejected(length: int) -> None:
    s = MessageScanner([b"Q"])
    with pytest.raises(ProtocolViolation) as ei:
        s.feed(b"d" + struct.pack("!I", length) + b"\x00" * 10)
    assert ei.value.sqlstate == "08P01"


def test_scanner_limit_is_on_body_size() -> None:
    s = MessageScanner([b"Q"], max_message_size=8)
    out, events = s.feed(frame(ord("Q"), b"12345678"))
    assert events == [(ord("Q"), 13, b"12345678")]
    with pytest.raises(ProtocolViolation):
        s.feed(frame(ord("Q"), b"123456789"))


# --- arbitrary bytes: only ProtocolViolation, always terminates -------------------------


garbage_st = st.binary(max_size=300)
limits_st = st.sampled_from([DEFAULT_MAX_MESSAGE_SIZE, 64, 0])


@pytest.mark.timeout(120)
@FUZZ
@given(data=garbage_st, cuts=cuts_st, limit=limits_st)
def test_reader_arbitrary_bytes(data: bytes, cuts: list[int], limit: int) -> None:
    r = MessageReader(max_message_size=limit)
    got: list[tuple[int, bytes]] = []
    try:
        for piece in split(data, cuts):
            r.feed(piece)
            got.extend(r.messages())
    except ProtocolViolation as exc:
        assert exc.sqlstate == "08P01"
        return
    # Without an error, the messages plus what is left reassemble the input.
    assert b"".join(frame(k, b) for k, b in got) + r.take_remaining() == data


@pytest.mark.timeout(120)
@FUZZ
@given(data=garbage_st, cuts=cuts_st, limit=limits_st, max_collect=st.integers(0, 64))
def test_scanner_arbitrary_bytes(
    data: bytes, cuts: list[int], limit: int, max_collect: int
) -> None:
    s = MessageScanner(WANT, max_message_size=limit, max_collect=max_collect)
    forwarded = b""
    try:
        for piece in split(data, cuts):
            out, events = s.feed(piece)
            for kind, end, body in events:
                assert kind in WANT
                assert 0 < end <= len(out)
                assert len(body) <= limit
            forwarded += out
    except ProtocolViolation as exc:
        assert exc.sqlstate == "08P01"
        return
    assert data.startswith(forwarded)
    # only an incomplete header (< 5 bytes) may be held back
    assert len(data) - len(forwarded) < 5


# --- the compiled scanner and the Python one ----------------------------------------------


def run_scanner(scanner: object, pieces: list[bytes], detach_at: int | None) -> list[object]:
    """Everything a scanner says about a stream: outputs, boundaries, errors, detach."""
    said: list[object] = []
    for i, piece in enumerate(pieces):
        if i == detach_at:
            said.append(("detach", scanner.detach()))  # type: ignore[attr-defined]
        try:
            said.append(scanner.feed(piece))  # type: ignore[attr-defined]
        except ProtocolViolation as exc:
            said.append(("error", str(exc)))
            return said
        said.append(scanner.at_boundary)  # type: ignore[attr-defined]
    return said


@pytest.mark.skipif(framing._CompiledScanner is None, reason="the extension was not built")
@FUZZ
@given(
    data=st.one_of(garbage_st, messages_st.map(lambda ms: b"".join(frame(k, b) for k, b in ms))),
    cuts=cuts_st,
    limit=limits_st,
    max_collect=st.integers(0, 64),
    detach_at=st.none() | st.integers(0, 5),
    mark=st.sampled_from([b"", b"D", b"Cd"]),
)
def test_compiled_scanner_says_what_the_python_one_says(
    data: bytes, cuts: list[int], limit: int, max_collect: int, detach_at: int | None, mark: bytes
) -> None:
    pieces = split(data, cuts)
    made = [
        cls(WANT, max_message_size=limit, max_collect=max_collect, mark=mark)
        for cls in (PyMessageScanner, framing._CompiledScanner)
    ]
    python, compiled = (run_scanner(s, pieces, detach_at) for s in made)
    assert compiled == python


def test_the_relay_uses_the_compiled_scanner_when_built() -> None:
    assert MessageScanner is (framing._CompiledScanner or PyMessageScanner)


@pytest.mark.parametrize("scanner", [MessageScanner, PyMessageScanner])
def test_partial_message_says_what_is_begun_and_how_much_of_it(scanner) -> None:
    s = scanner((b"P",), mark=(b"B",))
    parse = b"P" + struct.pack("!I", 4 + 9) + b"st\0select"
    assert s.partial_message() is None
    s.feed(b"S\0\0\0\x04" + parse[:8])  # a whole Sync, then a Parse's header and 3 bytes
    assert s.partial_message() == (ord("P"), 3)
    s.feed(parse[8:12])
    assert s.partial_message() == (ord("P"), 7)
    _, events = s.feed(parse[12:])
    assert s.partial_message() is None and events == [(ord("P"), 2, b"st\0select")]
    s.feed(b"X\0\0\0\x10")  # an unwanted message begun: nothing gathered
    assert s.partial_message() is None
