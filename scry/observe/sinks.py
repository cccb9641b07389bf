"""Where event batches go, and the background task that ships them.

``EventShipper`` takes batches out of the ``EventRing`` (when ``batch_size``
events are waiting or every ``flush_interval`` seconds; after a trip it
lingers up to ``linger`` seconds so that a busy proxy ships in few, large
trips; the drain's ``notify`` after each drain ends a linger, so no timer
fires under load), encodes them (``events.serialize_parts``, on the event
loop) and hands them to a sink:

``NullSink``   discards (the ``none`` sink).
``FileSink``   appends frames to a file, rotating by size and keeping
               ``keep`` old files (``events.log.1`` is the newest old one).
               It takes a whole trip in one call in a worker thread: one
               frame, compressed together, one write.
``HttpSink``   POSTs each batch (compressed in a worker thread), retrying
               with exponential backoff up to ``max_attempts``; a batch that
               still fails is dropped and counted. While a sink is slow the
               ring keeps filling and drops its oldest events: queries are
               never held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from scry.observe.events import (
    FLAG_GZIP,
    EventRing,
    compress_payload,
    frame,
    frame_batches,
    serialize_parts,
)


class Sink(Protocol):
    """Receives encoded batches. A sink may instead offer a blocking
    ``write_batches(payloads, compression)`` (the file sink): the shipper then
    hands it the uncompressed payloads of a whole trip in one call, made in a
    worker thread, and counts the trip lost if it raises."""

    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        """Deliver one batch; False when it was given up on."""
        ...

    async def close(self) -> None: ...


class NullSink:
    """The ``none`` sink."""

    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        return True

    async def close(self) -> None:
        return None


class FileSink:
    """Framed batches appended to ``path``, rotated at ``max_bytes``."""

    def __init__(self, path: str | Path, *, max_bytes: int = 64 << 20, keep: int = 5) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self._file: Any = None
        self._size = 0
        self.rotations = 0

    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        # Small appends, but still file I/O: keep it off the event loop.
        await asyncio.to_thread(self._write, frame(payload, flags))
        return True

    def write_batches(self, payloads: list[bytes], compression: str) -> None:
        """Several batches as one frame, compressed together (blocking: the
        shipper calls it in a worker thread, where every call that lets go
        of the GIL must win it back from the event loop)."""
        self._write(frame_batches(payloads, compression))

    def _write(self, data: bytes) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - kept open across batches
            self._size = self._file.tell()
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0
        self.rotations += 1

    async def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class HttpSink:
    """POST each batch to ``url``; retry with capped exponential backoff."""

    def __init__(
        self,
        url: str,
        *,
        client: httpx.AsyncClient | None = None,
        max_attempts: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        timeout: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.url = url
        self._client = client or httpx.AsyncClient(timeout=timeout)
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._sleep = sleep
        self.retries = 0
        self.failed_batches = 0

    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        headers = {
            "Content-Type": "application/x-scry-events+flexbuffers",
            "X-Scry-Events": str(count),
        }
        if flags & FLAG_GZIP:
            headers["Content-Encoding"] = "gzip"
        delay = self.backoff
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = await self._client.post(self.url, content=payload, headers=headers)
                if response.status_code < 500 and response.status_code != 429:
                    # 4xx other than 429 will not get better by retrying.
                    return response.is_success
            except httpx.HTTPError:
                pass
            if attempt == self.max_attempts:
                break
            self.retries += 1
            await self._sleep(delay)
            delay = min(delay * 2, self.max_backoff)
        self.failed_batches += 1
        return False

    async def close(self) -> None:
        await self._client.aclose()


def make_sink(events_config: Any) -> Sink:
    """The sink an ``EventsConfig`` asks for."""
    if events_config.sink == "file":
        return FileSink(events_config.path)
    if events_config.sink == "http":
        return HttpSink(events_config.url)
    return NullSink()


#: Batches encoded and handed to a sink per trip (the file sink writes them
#: as one frame).
MAX_BATCHES_PER_TRIP = 16


class EventShipper:
    """The background task that drains the ring into a sink in batches."""

    def __init__(
        self,
        ring: EventRing,
        sink: Sink,
        *,
        batch_size: int = 100,
        flush_interval: float = 1.0,
        linger: float = 0.0,
        compression: str = "gzip",
        on_flush: Callable[[int, float, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ring = ring
        self.sink = sink
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.linger = linger
        # After a trip the shipper lingers until this many events wait (or
        # ``linger`` passes): the ring must never fill while it does.
        self._backlog = max(batch_size, min(MAX_BATCHES_PER_TRIP * batch_size, ring.capacity // 2))
        self._clock = clock
        self._linger_until = 0.0  # (the first full batch goes at once)
        self.compression = compression
        self._on_flush = on_flush
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.batches = 0
        self.shipped = 0
        self.lost = 0  # events in batches a sink gave up on

    def notify(self) -> None:
        """Called after each drain: wake the shipper if a trip is due. A
        linger ends here, at the first drain after it, not by a timer of its
        own: no timer of the pipeline fires under load (timers firing under
        load cost tps; see docs/benchmarks.md, session 29)."""
        if self._due():
            self._wake.set()

    def _due(self) -> bool:
        """A full trip waits, or a full batch and the linger is over."""
        waiting = len(self.ring)
        return waiting >= self._backlog or (
            waiting >= self.batch_size and self._clock() >= self._linger_until
        )

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="scry-events")

    async def stop(self, timeout: float = 5.0) -> None:
        """Flush what is left (within ``timeout``) and close the sink."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        try:
            await asyncio.wait_for(self._task, timeout)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._task = None
        await self.sink.close()

    async def _run(self) -> None:
        while True:
            timed_out = False
            if not self._stopping and not self._due():
                timed_out = not await self._wait(self.flush_interval)
            # Full batches; after the interval (or when stopping) the rest too.
            partial = timed_out or self._stopping
            while len(self.ring) >= self.batch_size or (partial and self.ring):
                await self._ship(partial)
                partial = partial or self._stopping
            if self._stopping and not self.ring:
                return
            # Let the next batches gather: a trip costs the event loop and
            # the I/O thread a wake-up each, whether it holds one batch or 16.
            self._linger_until = self._clock() + self.linger

    async def _wait(self, timeout: float) -> bool:
        """Wait for notify (or stop) to wake the shipper (True) or for
        ``timeout`` to pass (False)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def flush_once(self) -> int:
        """Ship one batch now; returns how many events it held."""
        return await self._ship(True, max_batches=1)

    async def _ship(self, partial: bool, max_batches: int = MAX_BATCHES_PER_TRIP) -> int:
        """Encode up to ``max_batches`` batches of ``batch_size`` events (the
        last one short only if ``partial``) and deliver them (in one call when
        the sink has ``write_batches``); returns how many events they held."""
        raw: list[bytes] = []
        counts: list[int] = []
        encoding: list[float] = []
        while len(raw) < max_batches and (
            len(self.ring) >= self.batch_size or (partial and self.ring)
        ):
            started = time.perf_counter()
            parts = self.ring.take_parts(self.batch_size)
            raw.append(serialize_parts(parts))
            counts.append(sum(stop - start for _, start, stop in parts))
            encoding.append(time.perf_counter() - started)
            if len(raw) % 4 == 0:
                await asyncio.sleep(0)  # let queries through between encodings
        if not raw:
            return 0
        counts_and_times = zip(counts, encoding, strict=True)
        if hasattr(self.sink, "write_batches"):
            # One trip to a worker thread: compress and write together.
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self.sink.write_batches, raw, self.compression)
                ok = True
            except Exception:  # a broken sink must not kill the pipeline
                ok = False
            share = (time.perf_counter() - started) / len(raw)
            for count, encoded in counts_and_times:
                self._shipped(count, encoded + share, ok)
            return sum(counts)
        if self.compression == "gzip":
            # Compressed in a thread, all of a trip's batches in one hop:
            # deflate lets go of the GIL, and on the event loop's core its
            # tables evicted the drain's and the relay's data from the cache
            # (the drain ran 1.4 -> 2.0 µs a record right after a compress).
            compressed = await asyncio.to_thread(_compress_all, raw, self.compression)
        else:
            compressed = [(payload, 0, 0.0) for payload in raw]
        for (payload, flags, took), (count, encoded) in zip(
            compressed, counts_and_times, strict=True
        ):
            started = time.perf_counter()
            try:
                ok = await self.sink.write(payload, flags, count)
            except Exception:
                ok = False
            self._shipped(count, encoded + took + time.perf_counter() - started, ok)
        return sum(counts)

    def _shipped(self, count: int, seconds: float, ok: bool) -> None:
        self.batches += 1
        if ok:
            self.shipped += count
        else:
            self.lost += count
        if self._on_flush is not None:
            self._on_flush(count, seconds, ok)


def _compress_all(payloads: list[bytes], compression: str) -> list[tuple[bytes, int, float]]:
    """(compressed payload, flags, seconds it took) for each payload (run in
    a worker thread)."""
    out = []
    for payload in payloads:
        started = time.perf_counter()
        compressed, flags = compress_payload(payload, compression)
        out.append((compressed, flags, time.perf_counter() - started))
    return out
