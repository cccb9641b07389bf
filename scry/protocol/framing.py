"""Framing: cut a PostgreSQL v3 byte stream into messages.

Two readers, for two jobs:

``MessageReader``
    Hands out whole messages as ``(type, body)``. Used where every message
    matters and volume is low: login, authentication, backend setup.

``MessageScanner``
    The relay's hot path. It walks message headers in each received chunk,
    never copies a body it was not asked for, and returns the chunk ready to
    forward together with the few messages the proxy must look at (with their
    end offsets, so the caller can split the chunk at a message boundary).
    A header cut by a chunk boundary is held back until it is complete, so a
    forwarded chunk never ends inside a header; bodies may span chunks.

Both reject a length below 4 or above ``max_message_size`` with
``ProtocolViolation`` (08P01) before buffering anything.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable

from scry.protocol.errors import ProtocolViolation

_LEN = struct.Struct("!I")
_unpack_len = _LEN.unpack_from
_unpack_header = struct.Struct("!BI").unpack_from  # (type, length) of a message at an offset

DEFAULT_MAX_MESSAGE_SIZE = 0x3FFFFFFF  # PostgreSQL's own ceiling (MaxAllocSize - 1)
DEFAULT_MAX_COLLECT = 1 << 20  # largest body the scanner copies out for the caller


def _check_length(kind: int, length: int, limit: int) -> None:
    if length < 4:
        raise ProtocolViolation(f"invalid message length {length} for message type {chr(kind)!r}")
    if length - 4 > limit:
        raise ProtocolViolation(
            f"message of type {chr(kind)!r} claims {length - 4} bytes, "
            f"over the {limit}-byte limit (max_packet_size)"
        )


class MessageReader:
    """Accumulates bytes and yields complete ``(type, body)`` messages."""

    __slots__ = ("_buf", "_max")

    def __init__(self, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self._buf = bytearray()
        self._max = max_message_size

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_message(self) -> tuple[int, bytes] | None:
        """The next whole message, or None until more bytes arrive."""
        buf = self._buf
        if len(buf) < 5:
            return None
        kind = buf[0]
        (length,) = _unpack_len(buf, 1)
        _check_length(kind, length, self._max)
        end = 1 + length
        if len(buf) < end:
            return None
        body = bytes(buf[5:end])
        del buf[:end]
        return kind, body

    def messages(self) -> list[tuple[int, bytes]]:
        """All complete messages buffered so far."""
        out = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out

    def take_remaining(self) -> bytes:
        """Bytes buffered after the last whole message (handed on at a phase change)."""
        rest = bytes(self._buf)
        self._buf.clear()
        return rest

    @property
    def buffered(self) -> int:
        return len(self._buf)


# An event is (message type, end offset in the forwarded chunk, body or b"").
ScanEvent = tuple[int, int, bytes]
_NO_EVENTS: list[ScanEvent] = []  # shared and never mutated: callers only iterate


@functools.cache
def _want_table_cached(
    want: tuple[bytes | int, ...], mark: tuple[bytes | int, ...]
) -> dict[int, bool]:
    table = {w[0] if isinstance(w, bytes) else w: False for w in mark}
    table.update((w[0] if isinstance(w, bytes) else w, True) for w in want)
    return table


def _want_table(want: Iterable[bytes | int], mark: Iterable[bytes | int]) -> dict[int, bool]:
    """The scanner's lookup table; built once per (want, mark) and shared (never mutated)."""
    return _want_table_cached(tuple(want), tuple(mark))


class PyMessageScanner:
    """Finds the messages of interest in a stream without copying the rest.

    The reference implementation; ``MessageScanner`` is its compiled twin
    (scry/protocol/_scan.pyx) when that was built.
    """

    __slots__ = (
        "_want",
        "_max",
        "_max_collect",
        "_held",
        "_remaining",
        "_collect",
        "_collect_limit",
        "_kind",
    )

    def __init__(
        self,
        want: Iterable[bytes | int],
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_collect: int = DEFAULT_MAX_COLLECT,
        mark: Iterable[bytes | int] = (),
    ) -> None:
        # message type -> copy its body? (``mark`` types are reported with b"").
        self._want = _want_table(want, mark)
        self._max = max_message_size
        self._max_collect = max_collect
        self._held = b""  # an incomplete header from the previous chunk
        self._remaining = 0  # body bytes of the current message still to come
        self._collect: bytearray | None = None  # body being gathered across chunks
        self._collect_limit = max_collect
        self._kind = 0

    @property
    def at_boundary(self) -> bool:
        """True when the stream so far ends exactly between two messages."""
        return not self._remaining and not self._held

    def partial_message(self) -> tuple[int, int] | None:
        """(type, body bytes gathered so far) of a wanted message begun in the
        stream and not complete yet (up to max_collect); None if there is none."""
        if not self._remaining or self._collect is None:
            return None
        return self._kind, len(self._collect)

    def detach(self) -> bytes:
        """Stop scanning: return the held-back partial header and reset."""
        held = self._held
        self._held = b""
        self._remaining = 0
        self._collect = None
        return held

    def feed(self, data: bytes) -> tuple[bytes, list[ScanEvent]]:
        """Scan ``data``; return (bytes to forward, wanted messages completed in them)."""
        n = len(data)
        if not self._held and not self._remaining and n >= 5:
            # Fast path: the chunk is exactly one whole message (a Query, a
            # short response); no loop, no list unless it is wanted.
            (length,) = _unpack_len(data, 1)
            if length + 1 == n and 4 <= length <= self._max + 4:
                kind = data[0]
                copy = self._want.get(kind)
                if copy is not None:
                    return data, [(kind, n, data[5 : 5 + self._max_collect] if copy else b"")]
                return data, _NO_EVENTS
        if self._held:
            data = self._held + data
            self._held = b""
            n = len(data)
        events: list[ScanEvent] = []
        pos = self._remaining
        if pos:
            collect = self._collect
            if pos > n:
                if collect is not None:
                    self._gather(collect, data)
                self._remaining = pos - n
                return data, events
            if collect is not None:
                self._gather(collect, data[:pos])
                events.append((self._kind, pos, bytes(collect)))
                self._collect = None
            self._remaining = 0
        want = self._want
        limit = self._max
        max_collect = self._max_collect
        append = events.append
        while n - pos >= 5:
            kind, length = _unpack_header(data, pos)
            if length < 4 or length - 4 > limit:
                _check_length(kind, length, limit)
            end = pos + 1 + length
            if end > n:
                self._remaining = end - n
                copy = want.get(kind)
                if copy is not None:
                    self._kind = kind
                    self._collect = bytearray()
                    self._collect_limit = max_collect if copy else 0
                    self._gather(self._collect, data[pos + 5 :])
                return data, events
            copy = want.get(kind)
            if copy is not None:
                if copy:
                    stop = pos + 5 + max_collect
                    append((kind, end, data[pos + 5 : end if end < stop else stop]))
                else:
                    append((kind, end, b""))
            pos = end
        if pos < n:
            self._held = data[pos:]
            data = data[:pos]
        return data, events

    def _gather(self, collect: bytearray, part: bytes) -> None:
        room = self._collect_limit - len(collect)
        if room > 0:
            collect += part[:room]


try:  # the compiled twin, built by setup.py when a C compiler is at hand
    from scry.protocol._scan import MessageScanner as _CompiledScanner
except ImportError:
    _CompiledScanner = None

MessageScanner: type[PyMessageScanner] = _CompiledScanner or PyMessageScanner  # type: ignore[assignment]
