"""Per-query events: the ring buffer, the live tail, and the batch format.

An event has the fields of ``EVENT_FIELDS``. The pipeline builds them a
drained chunk at a time as an ``EventBlock`` (one list per field: built and
encoded with whole-column operations, no tuple per event), pushes the block
into an ``EventRing`` (bounded; when full the OLDEST events are dropped and
counted), and the shipper in ``scry.observe.sinks`` takes them out in
batches. Tail subscribers and readers get each event as a dict; tuples in
``EVENT_FIELDS`` order are accepted wherever events are.

Batch format
------------
A batch is one FlexBuffers map, columnar so that encoding costs a handful of
FlexBuffers values per batch instead of one map per event (laid out by
``_batch_map``; read back with ``flatbuffers.flexbuffers``)::

    {"v": 1, "n": <events>, "layout": "ts:d worker:i client_id:S ...",
     "strings": <blob: UTF-8 strings joined by NUL>,
     "columns": <blob: one little-endian array of n items per layout field>}

Layout codes: ``d`` float64, ``i`` int32, ``q`` int64, ``?`` uint8 bool,
``S`` uint32 index into strings, ``s`` int32 index or -1 for null, ``L``
uint32 index of a comma-joined list ("" = empty).

File framing
------------
A frame is a 12-byte header then the payload: ``b"SCEV"``, version (u8, 1),
flags (u8: bit 0 = gzip, bit 1 = several batches), reserved (u16), payload
length (u32, little-endian). The payload (once gunzipped) is one batch, or
with bit 1 several, each preceded by its length (u32, little-endian): the
file sink writes all the batches of one trip as one frame, compressed
together. ``read_events`` streams frames and stops quietly at a truncated
last frame (a crash mid-write).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import IO, Any

from flatbuffers import flexbuffers

try:  # ISA-L's deflate: the same gzip members, a quarter of zlib's CPU at its level 0
    from isal import isal_zlib as _deflate

    _GZIP_LEVEL = 0
except ImportError:  # pragma: no cover - isal is a dependency; zlib is always there
    _deflate = zlib  # type: ignore[misc]
    _GZIP_LEVEL = 1

EVENT_FIELDS = (
    "ts",
    "worker",
    "client_id",
    "database",
    "user",
    "application_name",
    "fingerprint",
    "query",
    "queue_us",
    "pool_acquire_us",
    "backend_us",
    "total_us",
    "rows",
    "sqlstate",
    "pinned",
    "pin_reasons",
)
_CODES = ("d", "i", "S", "S", "S", "S", "S", "S", "q", "q", "q", "q", "q", "s", "?", "L")
LAYOUT = " ".join(f"{name}:{code}" for name, code in zip(EVENT_FIELDS, _CODES, strict=True))
_LAYOUT_CODES = "".join(_CODES).encode("ascii")
_ARRAY_TYPE = {"d": "d", "i": "i", "q": "q", "?": "B", "S": "I", "s": "i", "L": "I"}

MAGIC = b"SCEV"
HEADER = struct.Struct("<4sBBHI")
FLAG_GZIP = 1
FLAG_BATCHES = 2
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip member (header, deflate, CRC-32 and size)


def event_dict(event: tuple[Any, ...]) -> dict[str, Any]:
    """An event tuple as a dict (pin_reasons as a list)."""
    d = dict(zip(EVENT_FIELDS, event, strict=True))
    d["pin_reasons"] = list(d["pin_reasons"] or ())
    return d


# --------------------------------------------------------------------------- #
# Event blocks and the ring buffer
# --------------------------------------------------------------------------- #


class EventBlock:
    """Events column by column (``EVENT_FIELDS`` order), in record order.

    The pipeline builds one block per drained chunk with whole-column
    operations (``map``, ``zip``), the ring keeps blocks, and the encoder
    turns columns straight into arrays: no event ever needs a tuple of its
    own unless a live-tail subscriber asks for rows. A column is any
    sequence (list, tuple, or an ``array`` for numbers) of ``n`` values.
    """

    __slots__ = ("columns", "n")

    def __init__(self, columns: Sequence[Sequence[Any]], n: int) -> None:
        self.columns = columns
        self.n = n

    @classmethod
    def of_events(cls, events: Sequence[tuple[Any, ...]]) -> EventBlock:
        """A block of event tuples."""
        return cls(list(zip(*events, strict=True)), len(events))

    def __len__(self) -> int:
        return self.n

    def rows(self) -> list[tuple[Any, ...]]:
        """The events as tuples."""
        if not self.n:
            return []
        return list(zip(*self.columns, strict=True))

    def slice(self, start: int, stop: int) -> EventBlock:
        """Events ``start`` to ``stop`` (clamped to the block)."""
        start, stop = max(0, start), min(stop, self.n)
        if start == 0 and stop == self.n:
            return self
        return EventBlock([c[start:stop] for c in self.columns], max(0, stop - start))

    @classmethod
    def concat(cls, blocks: Sequence[EventBlock]) -> EventBlock:
        """One block holding the events of ``blocks`` in order."""
        blocks = [b for b in blocks if b.n]
        if len(blocks) == 1:
            return blocks[0]
        if not blocks:
            return cls([], 0)
        columns = [_joined(parts) for parts in zip(*(b.columns for b in blocks), strict=True)]
        return cls(columns, sum(b.n for b in blocks))


def _concat_parts(parts: Sequence[tuple[Sequence[Sequence[Any]], int, int]]) -> EventBlock:
    """One block of the events of ``(columns, start, stop)`` slices, in order."""
    return EventBlock.concat(
        [
            EventBlock(columns, len(columns[0]) if columns else 0).slice(start, stop)
            for columns, start, stop in parts
        ]
    )


def _joined(parts: Sequence[Sequence[Any]]) -> Sequence[Any]:
    """One column of several blocks: an array when they all are arrays of
    one type (a copy of their bytes), else a list."""
    first = parts[0]
    if first.__class__ is array and all(
        p.__class__ is array and p.typecode == first.typecode  # type: ignore[attr-defined]
        for p in parts
    ):
        joined = array(first.typecode)  # type: ignore[attr-defined]
        for part in parts:
            joined.extend(part)  # type: ignore[arg-type]
        return joined
    return list(chain.from_iterable(parts))


class EventRing:
    """Bounded FIFO of events that drops the oldest when full, counting drops.

    Holds ``EventBlock``s (a drain's worth each); ``len`` counts events.
    """

    __slots__ = ("capacity", "_blocks", "_head", "_len", "pushed", "dropped")

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._blocks: deque[EventBlock] = deque()
        self._head = 0  # events of _blocks[0] already taken or dropped
        self._len = 0
        self.pushed = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._len

    def push(self, event: tuple[Any, ...]) -> None:
        """Append an event; the oldest is dropped (and counted) when full."""
        self.extend(EventBlock.of_events([event]))

    def extend(self, events: EventBlock | Sequence[tuple[Any, ...]]) -> None:
        """Append events (a block, or event tuples) in order; drop the oldest
        beyond ``capacity``, counted."""
        block = events if isinstance(events, EventBlock) else EventBlock.of_events(events)
        if not block.n:
            return
        self._blocks.append(block)
        self._len += block.n
        self.pushed += block.n
        over = self._len - self.capacity
        if over > 0:
            self.dropped += over
            self._discard(over)

    def _discard(self, count: int) -> None:
        blocks = self._blocks
        self._len -= count
        while count:
            left = blocks[0].n - self._head
            if left <= count:
                blocks.popleft()
                self._head = 0
                count -= left
            else:
                self._head += count
                count = 0

    def take_block(self, limit: int) -> EventBlock:
        """Remove and return up to ``limit`` of the oldest events, as one block."""
        return _concat_parts(self.take_parts(limit))

    def take_parts(self, limit: int) -> list[tuple[Sequence[Sequence[Any]], int, int]]:
        """Remove up to ``limit`` of the oldest events and return them as
        ``(columns, start, stop)`` slices of the blocks that held them, in
        order (for ``encode_parts``: no column is copied)."""
        blocks = self._blocks
        parts = []
        need = min(limit, self._len)
        self._len -= need
        while need:
            block, head = blocks[0], self._head
            left = block.n - head
            if left <= need:
                parts.append((block.columns, head, block.n))
                blocks.popleft()
                self._head = 0
                need -= left
            else:
                parts.append((block.columns, head, head + need))
                self._head = head + need
                need = 0
        return parts

    def take(self, limit: int) -> list[tuple[Any, ...]]:
        """Remove and return up to ``limit`` of the oldest events, as tuples."""
        return self.take_block(limit).rows()


# --------------------------------------------------------------------------- #
# Live tail
# --------------------------------------------------------------------------- #


class Subscription:
    """A bounded, asyncio.Queue-like view of the event stream for one reader.

    A slow reader never slows the pipeline: when its buffer is full the
    oldest event is dropped and ``dropped`` counts it.
    """

    def __init__(
        self,
        predicate: Callable[[dict[str, Any]], bool] | None,
        maxsize: int,
        on_close: Callable[[Subscription], None],
    ) -> None:
        self._predicate = predicate
        self._buffer: deque[dict[str, Any]] = deque(maxlen=maxsize)
        self._ready = asyncio.Event()
        self._on_close = on_close
        self.maxsize = maxsize
        self.dropped = 0
        self.closed = False

    def offer(self, event: dict[str, Any]) -> None:
        """Called by the pipeline for every event."""
        if self._predicate is not None and not self._predicate(event):
            return
        if len(self._buffer) == self.maxsize:
            self.dropped += 1
        self._buffer.append(event)
        self._ready.set()

    def qsize(self) -> int:
        return len(self._buffer)

    def empty(self) -> bool:
        return not self._buffer

    def get_nowait(self) -> dict[str, Any]:
        """The oldest buffered event; raises ``asyncio.QueueEmpty``."""
        if not self._buffer:
            raise asyncio.QueueEmpty
        return self._buffer.popleft()

    async def get(self) -> dict[str, Any]:
        """Wait for the next event."""
        while not self._buffer:
            if self.closed:
                raise asyncio.CancelledError("subscription closed")
            self._ready.clear()
            await self._ready.wait()
        return self._buffer.popleft()

    def close(self) -> None:
        """Stop receiving events."""
        if not self.closed:
            self.closed = True
            self._ready.set()
            self._on_close(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self.get()
        except asyncio.CancelledError:
            if self.closed:
                raise StopAsyncIteration from None
            raise


def make_predicate(
    spec: Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None,
) -> Callable[[dict[str, Any]], bool] | None:
    """A filter from a callable or a mapping ``field -> wanted value``.

    Mapping keys are event fields (equality), plus ``min_total_us`` and
    ``errors_only``.
    """
    if spec is None or callable(spec):
        return spec
    wanted = dict(spec)
    min_total = wanted.pop("min_total_us", None)
    errors_only = wanted.pop("errors_only", False)
    unknown = set(wanted) - set(EVENT_FIELDS)
    if unknown:
        raise ValueError(f"unknown event fields in filter: {', '.join(sorted(unknown))}")

    def predicate(event: dict[str, Any]) -> bool:
        if min_total is not None and event["total_us"] < min_total:
            return False
        if errors_only and event["sqlstate"] is None:
            return False
        return all(event[k] == v for k, v in wanted.items())

    return predicate


# --------------------------------------------------------------------------- #
# Batch encoding
# --------------------------------------------------------------------------- #


def encode_batch(
    events: EventBlock | Sequence[tuple[Any, ...]], compression: str = "gzip"
) -> tuple[bytes, int]:
    """(payload, flags) for a batch of events (a block, or event tuples)."""
    block = events if isinstance(events, EventBlock) else EventBlock.of_events(events)
    return encode_parts([(block.columns, 0, block.n)], compression)


def encode_parts(
    parts: list[tuple[Sequence[Sequence[Any]], int, int]], compression: str = "gzip"
) -> tuple[bytes, int]:
    """(payload, flags) for one batch of the events ``parts`` hold, in order:
    ``(columns, start, stop)`` each, a slice of a block's columns (what
    ``EventRing.take_parts`` gives: nothing is copied to cut a batch out)."""
    return compress_payload(serialize_parts(parts), compression)


def serialize_parts(parts: list[tuple[Sequence[Sequence[Any]], int, int]]) -> bytes:
    """The uncompressed payload of ``encode_parts``: the FlexBuffers map
    (needs the GIL throughout; compressing it need not)."""
    n = sum(stop - start for _, start, stop in parts)
    try:
        table, columns = encode_columns(parts, _LAYOUT_CODES)
    except (OverflowError, TypeError, ValueError):
        # The compiled walk only takes what it encodes exactly as the twin
        # does; the twin encodes the rest (or raises the error it always did).
        table, columns = py_encode_columns(parts, _LAYOUT_CODES)
    return _batch_map(n, table, columns)


def py_encode_columns(
    parts: list[tuple[Sequence[Sequence[Any]], int, int]], codes: bytes
) -> tuple[bytes, bytes]:
    """(string table, columns) of a batch: the events of ``parts`` (see
    ``encode_parts``) as one little-endian array of n items per layout code
    in ``codes``, strings as indexes into the table (UTF-8, NUL-separated,
    "" first, in order of first use, column by column)."""
    block = _concat_parts(parts)
    n = block.n
    strings: dict[str, int] = {"": 0}
    columns = bytearray()
    for code, values in zip(codes.decode("ascii"), block.columns or [()] * len(codes), strict=True):
        if code == "S":
            data = _indexes(strings, values, n)
        elif code == "L":
            if not any(values):
                data = array("I", bytes(4 * n))  # no pins: all ""
            else:
                data = _indexes(strings, [",".join(v) if v else "" for v in values], n)
        elif code == "s":
            if values.count(None) == n:
                data = array("i", [-1]) * n
            else:
                data = array(
                    "i", [-1 if v is None else strings.setdefault(v, len(strings)) for v in values]
                )
        elif values.__class__ is array and values.typecode == _ARRAY_TYPE[code]:
            data = values if sys.byteorder == "little" else array(values.typecode, values)
        else:
            data = array(_ARRAY_TYPE[code], values)
        if sys.byteorder == "big":
            data.byteswap()
        columns += data
    return "\0".join(strings).encode("utf-8", "surrogatepass"), bytes(columns)


def compress_payload(payload: bytes, compression: str = "gzip") -> tuple[bytes, int]:
    """(payload, flags) of an uncompressed batch payload."""
    if compression == "gzip":
        # The gzip wrapper and its CRC come from the one deflate pass
        # (gzip.compress takes a second pass for the CRC). On pgbench's
        # events ISA-L's level 0 takes 0.08 µs an event against zlib's 0.32
        # at level 1, for 1.9 KB a batch of 100 against 1.5 (9 KB raw).
        return _deflate.compress(payload, _GZIP_LEVEL, _GZIP_WBITS), FLAG_GZIP
    return payload, 0


def _indexes(strings: dict[str, int], values: Sequence[str], n: int) -> array[int]:
    """The string-table index of each value, adding new strings as they come."""
    if n and values.count(values[0]) == n:  # one value throughout (database, user...)
        return array("I", [strings.setdefault(values[0], len(strings))]) * n
    return array("I", [strings.setdefault(v, len(strings)) for v in values])


# The batch map, written directly. The FlexBuffers encoder of the flatbuffers
# package builds it in ~60 µs (hundreds of Python calls), more than encoding
# 100 events; the map's shape never changes, so it is laid out here with
# 32-bit widths throughout, and the tests read it back with
# ``flexbuffers.Loads`` against what ``flexbuffers.Dumps`` makes of the same
# batch. Layout: the keys (sorted), the layout string, the strings and columns
# blobs, the keys vector, the map (keys offset, keys width, size, 5 values,
# 5 types), the root (offset, type, width). Offsets point backwards from
# where they are stored; every length prefix is 4-aligned.
_KEYS = (b"columns", b"layout", b"n", b"strings", b"v")
_U32 = struct.Struct("<I")
_TYPE_INT, _TYPE_STRING, _TYPE_MAP, _TYPE_BLOB = 1, 5, 9, 25
_W32 = 2  # FlexBuffers bit-width code of 4 bytes
_MAP_TYPES = bytes(
    (t << 2) | _W32 for t in (_TYPE_BLOB, _TYPE_STRING, _TYPE_INT, _TYPE_BLOB, _TYPE_INT)
)
_ROOT_TRAILER = bytes(((_TYPE_MAP << 2) | _W32, 4))


def _pad4(size: int) -> bytes:
    return bytes(-size % 4)


def _prefix() -> tuple[bytes, tuple[int, ...], int]:
    out = bytearray()
    key_positions = []
    for key in _KEYS:
        key_positions.append(len(out))
        out += key + b"\0"
    out += _pad4(len(out))
    layout = LAYOUT.encode("ascii")
    out += _U32.pack(len(layout))
    layout_at = len(out)
    out += layout + b"\0"
    out += _pad4(len(out))
    return bytes(out), tuple(key_positions), layout_at


_PREFIX, _KEY_POSITIONS, _LAYOUT_AT = _prefix()


def _batch_map(n: int, strings: bytes, columns: bytes | bytearray) -> bytes:
    """``flexbuffers.Dumps({"v": 1, "n": n, "layout": LAYOUT, "strings":
    strings, "columns": columns})``, equivalent (not byte-identical)."""
    pos = len(_PREFIX)
    strings_at = pos + 4
    pos = strings_at + len(strings)
    strings_pad = _pad4(pos)
    pos += len(strings_pad)
    columns_at = pos + 4
    pos = columns_at + len(columns)
    columns_pad = _pad4(pos)
    pos += len(columns_pad)
    keys_at = pos + 4
    keys = struct.pack(
        "<6I", len(_KEYS), *(keys_at + 4 * i - at for i, at in enumerate(_KEY_POSITIONS))
    )
    field = keys_at + 4 * len(_KEYS)  # the map's keys-offset field
    values_at = field + 12
    the_map = struct.pack(
        "<8I",
        field - keys_at,
        4,
        len(_KEYS),
        values_at - columns_at,
        values_at + 4 - _LAYOUT_AT,
        n,
        values_at + 12 - strings_at,
        1,
    )
    pos = values_at + 4 * len(_KEYS) + len(_MAP_TYPES)
    types_pad = _pad4(pos)
    pos += len(types_pad)
    return b"".join(
        (
            _PREFIX,
            _U32.pack(len(strings)),
            strings,
            strings_pad,
            _U32.pack(len(columns)),
            columns,
            columns_pad,
            keys,
            the_map,
            _MAP_TYPES,
            types_pad,
            _U32.pack(pos - values_at),
            _ROOT_TRAILER,
        )
    )


def frame(payload: bytes, flags: int) -> bytes:
    """A payload with its file header."""
    return HEADER.pack(MAGIC, 1, flags, 0, len(payload)) + payload


def frame_batches(payloads: Sequence[bytes], compression: str = "gzip") -> bytes:
    """Encoded batches as one frame, compressed together (one deflate call
    for a whole trip: in the shipper's worker thread, each call lets go of
    the GIL and must win it back from the event loop)."""
    if len(payloads) == 1:
        return frame(*compress_payload(payloads[0], compression))
    parts: list[bytes] = []
    for payload in payloads:
        parts.append(_U32.pack(len(payload)))
        parts.append(payload)
    data, flags = compress_payload(b"".join(parts), compression)
    return frame(data, flags | FLAG_BATCHES)


def frame_payloads(payload: bytes, flags: int) -> list[bytes]:
    """The batch payloads of one frame's payload, decompressed."""
    if flags & FLAG_GZIP:
        payload = gzip.decompress(payload)
    if not flags & FLAG_BATCHES:
        return [payload]
    out = []
    pos = 0
    while pos < len(payload):
        (length,) = _U32.unpack_from(payload, pos)
        end = pos + 4 + length
        if end > len(payload):
            raise ValueError("a batch runs past the end of its frame")
        out.append(payload[pos + 4 : end])
        pos = end
    return out


def decode_batch(payload: bytes, flags: int = 0) -> list[dict[str, Any]]:
    """Event dicts from one batch payload."""
    if flags & FLAG_GZIP:
        payload = gzip.decompress(payload)
    batch = flexbuffers.Loads(payload)
    n = batch["n"]
    strings = bytes(batch["strings"]).decode("utf-8", "surrogatepass").split("\0")
    raw = bytes(batch["columns"])
    columns: dict[str, list[Any]] = {}
    offset = 0
    for spec in batch["layout"].split():
        name, code = spec.split(":")
        data = array(_ARRAY_TYPE[code])
        size = data.itemsize * n
        data.frombytes(raw[offset : offset + size])
        offset += size
        if sys.byteorder == "big":
            data.byteswap()
        if code == "S":
            values: list[Any] = [strings[i] for i in data]
        elif code == "s":
            values = [None if i < 0 else strings[i] for i in data]
        elif code == "L":
            values = [strings[i].split(",") if strings[i] else [] for i in data]
        elif code == "?":
            values = [bool(v) for v in data]
        else:
            values = data.tolist()
        columns[name] = values
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """Stream the events of one events file written by the file sink."""
    with open(path, "rb") as f:
        while True:
            header = f.read(HEADER.size)
            if len(header) < HEADER.size:
                return
            magic, version, flags, _reserved, length = HEADER.unpack(header)
            if magic != MAGIC or version != 1:
                raise ValueError(f"{path}: not a scry events file (bad frame header)")
            payload = f.read(length)
            if len(payload) < length:
                return  # a frame cut short by a crash: everything before it is good
            for batch in frame_payloads(payload, flags):
                yield from decode_batch(batch)


def events_read_main(path: str, out: IO[str] | None = None) -> int:
    """``scry events read FILE``: print the events as JSON lines (to stdout by
    default); returns the exit status."""
    out = sys.stdout if out is None else out
    try:
        for event in read_events(path):
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
    except BrokenPipeError:
        return 0
    except (OSError, ValueError) as exc:
        print(f"scry events read: {exc}", file=sys.stderr)
        return 1
    return 0


try:  # the compiled twin (scry/observe/_encode.pyx), when it was built
    from scry.observe._encode import encode_columns as _compiled_encode_columns
except ImportError:  # pragma: no cover - built wherever a C compiler was at hand
    _compiled_encode_columns = None
# (The compiled walk writes native byte order: little-endian machines only.)
encode_columns = (
    _compiled_encode_columns
    if _compiled_encode_columns is not None and sys.byteorder == "little"
    else py_encode_columns
)
