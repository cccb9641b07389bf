"""Per-query events: the ring buffer, the live tail, and the batch format.

An event is a tuple in ``EVENT_FIELDS`` order (a dict only for tail
subscribers and readers). The pipeline pushes events into an ``EventRing``
(bounded; when full the OLDEST event is dropped and counted) and the shipper
in ``scry.observe.sinks`` takes them out in batches.

Batch format
------------
A batch is one FlexBuffers map (``flatbuffers.flexbuffers``), columnar so
that encoding costs a handful of FlexBuffers values per batch instead of one
map per event (the pure-Python encoder spends ~100 µs on a 16-field map)::

    {"v": 1, "n": <events>, "layout": "ts:d worker:i client_id:S ...",
     "strings": <blob: UTF-8 strings joined by NUL>,
     "columns": <blob: one little-endian array of n items per layout field>}

Layout codes: ``d`` float64, ``i`` int32, ``q`` int64, ``?`` uint8 bool,
``S`` uint32 index into strings, ``s`` int32 index or -1 for null, ``L``
uint32 index of a comma-joined list ("" = empty).

File framing
------------
Each batch is written as a 12-byte header then the payload:
``b"SCEV"``, version (u8, 1), flags (u8: bit 0 = gzip), reserved (u16),
payload length (u32, little-endian). ``read_events`` streams frames and stops
quietly at a truncated last frame (a crash mid-write).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from flatbuffers import flexbuffers

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
_ARRAY_TYPE = {"d": "d", "i": "i", "q": "q", "?": "B", "S": "I", "s": "i", "L": "I"}

MAGIC = b"SCEV"
HEADER = struct.Struct("<4sBBHI")
FLAG_GZIP = 1


def event_dict(event: tuple[Any, ...]) -> dict[str, Any]:
    """An event tuple as a dict (pin_reasons as a list)."""
    d = dict(zip(EVENT_FIELDS, event, strict=True))
    d["pin_reasons"] = list(d["pin_reasons"] or ())
    return d


# --------------------------------------------------------------------------- #
# Ring buffer
# --------------------------------------------------------------------------- #


class EventRing:
    """Bounded FIFO of events that drops the oldest when full, counting drops."""

    __slots__ = ("capacity", "_events", "pushed", "dropped")

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._events: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self.pushed = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def push(self, event: tuple[Any, ...]) -> None:
        """Append an event; the oldest is dropped (and counted) when full."""
        if len(self._events) == self.capacity:
            self.dropped += 1
        self._events.append(event)
        self.pushed += 1

    def extend(self, events: list[tuple[Any, ...]]) -> None:
        """``push`` each of ``events``, in order."""
        over = len(self._events) + len(events) - self.capacity
        if over > 0:
            self.dropped += over
        self._events.extend(events)
        self.pushed += len(events)

    def take(self, limit: int) -> list[tuple[Any, ...]]:
        """Remove and return up to ``limit`` of the oldest events."""
        events = self._events
        n = min(limit, len(events))
        return [events.popleft() for _ in range(n)]


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


def encode_batch(events: list[tuple[Any, ...]], compression: str = "gzip") -> tuple[bytes, int]:
    """(payload, flags) for a batch of event tuples."""
    strings: dict[str, int] = {"": 0}
    columns = bytearray()
    for code, values in zip(_CODES, zip(*events, strict=True), strict=True):
        if code in "SL":
            if code == "L":
                values = tuple(",".join(v) if v else "" for v in values)
            data = array("I", [strings.setdefault(v, len(strings)) for v in values])
        elif code == "s":
            data = array(
                "i", [-1 if v is None else strings.setdefault(v, len(strings)) for v in values]
            )
        else:
            data = array(_ARRAY_TYPE[code], values)
        if sys.byteorder == "big":
            data.byteswap()
        columns += data.tobytes()
    table = "\0".join(strings).encode("utf-8", "surrogatepass")
    payload = bytes(
        flexbuffers.Dumps(
            {"v": 1, "n": len(events), "layout": LAYOUT, "strings": table, "columns": columns}
        )
    )
    if compression == "gzip":
        return gzip.compress(payload, compresslevel=1), FLAG_GZIP
    return payload, 0


def frame(payload: bytes, flags: int) -> bytes:
    """A payload with its file header."""
    return HEADER.pack(MAGIC, 1, flags, 0, len(payload)) + payload


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
                return  # a batch cut short by a crash: everything before it is good
            yield from decode_batch(payload, flags)


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
