"""Ring buffer, batch format, file sink with rotation, http sink, live tail."""

from __future__ import annotations

import asyncio
import io
import json
from array import array
from pathlib import Path

import httpx
import pytest
from flatbuffers import flexbuffers
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.observe import events as events_module
from scry.observe.events import (
    EVENT_FIELDS,
    FLAG_BATCHES,
    FLAG_GZIP,
    HEADER,
    LAYOUT,
    EventBlock,
    EventRing,
    Subscription,
    _batch_map,
    decode_batch,
    encode_batch,
    encode_parts,
    event_dict,
    events_read_main,
    frame,
    frame_batches,
    frame_payloads,
    make_predicate,
    read_events,
)
from scry.observe.sinks import EventShipper, FileSink, HttpSink


def _event(i: int, **changes: object) -> tuple:
    base = dict(
        ts=1_700_000_000.0 + i,
        worker=1,
        client_id=f"c{i % 3}",
        database="db",
        user="u",
        application_name="pgbench",
        fingerprint="0123456789abcdef",
        query="SELECT abalance FROM pgbench_accounts WHERE aid = $1",
        queue_us=i,
        pool_acquire_us=0,
        backend_us=100 + i,
        total_us=101 + 2 * i,
        rows=1,
        sqlstate=None if i % 5 else "57014",
        pinned=bool(i % 7 == 0),
        pin_reasons=("set", "prepare") if i % 7 == 0 else (),
    )
    base.update(changes)
    return tuple(base[f] for f in EVENT_FIELDS)


def test_ring_drops_oldest_and_counts() -> None:
    ring = EventRing(3)
    for i in range(5):
        ring.push((i,))
    assert ring.dropped == 2 and ring.pushed == 5 and len(ring) == 3
    assert ring.take(10) == [(2,), (3,), (4,)]
    assert ring.take(10) == []


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_batch_roundtrip(compression: str) -> None:
    events = [_event(i) for i in range(20)]
    payload, flags = encode_batch(events, compression)
    decoded = decode_batch(payload, flags)
    assert decoded == [event_dict(e) for e in events]
    assert decoded[0]["pin_reasons"] == ["set", "prepare"] and decoded[0]["sqlstate"] == "57014"
    assert decoded[1]["sqlstate"] is None and decoded[1]["pinned"] is False


async def test_file_sink_roundtrip_through_read_events(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    ring = EventRing(1000)
    shipper = EventShipper(ring, FileSink(path), batch_size=10, flush_interval=0.05)
    shipper.start()
    for i in range(35):
        ring.push(_event(i))
    shipper.notify()
    await shipper.stop()  # (ships what is left first)
    events = list(read_events(path))
    assert [e["queue_us"] for e in events] == list(range(35))
    assert shipper.batches == 4 and shipper.shipped == 35
    out = io.StringIO()
    assert events_read_main(str(path), out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 35 and json.loads(lines[3])["client_id"] == "c0"


def test_reader_stops_at_a_truncated_last_frame(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    good = frame(*encode_batch([_event(1)]))
    path.write_bytes(good + good[:-5])
    assert len(list(read_events(path))) == 1
    path.write_bytes(b"nonsense" * 3)
    with pytest.raises(ValueError):
        list(read_events(path))
    assert events_read_main(str(path), io.StringIO()) == 1


async def test_file_sink_rotates_and_keeps_k_files(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    sink = FileSink(path, max_bytes=2_000, keep=2)
    payload, flags = encode_batch([_event(i) for i in range(10)], "none")
    for _ in range(10):
        await sink.write(payload, flags, 10)
    await sink.close()
    assert sink.rotations >= 3
    _check_rotated(tmp_path, max(2_000, len(frame(payload, flags))))


def _check_rotated(directory: Path, max_size: int) -> None:
    assert sorted(p.name for p in directory.iterdir()) == [
        "events.log",
        "events.log.1",
        "events.log.2",
    ]
    for p in directory.iterdir():
        assert p.stat().st_size <= max_size
        assert len(list(read_events(p))) % 10 == 0


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


async def test_http_sink_retries_with_backoff_then_succeeds() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(503 if len(seen) < 3 else 200)

    sleeps = Sleeps()
    sink = HttpSink(
        "http://collector/events",
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        backoff=0.1,
        sleep=sleeps,
    )
    payload, flags = encode_batch([_event(1), _event(2)])
    assert await sink.write(payload, flags, 2) is True
    assert sleeps.calls == [0.1, 0.2]
    assert seen[-1].headers["content-encoding"] == "gzip"
    assert seen[-1].headers["x-scry-events"] == "2"
    assert decode_batch(seen[-1].content, flags)[1]["queue_us"] == 2
    await sink.close()


async def test_http_sink_gives_up_after_the_bound() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    sleeps = Sleeps()
    sink = HttpSink(
        "http://collector/events",
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        max_attempts=4,
        backoff=1.0,
        max_backoff=2.5,
        sleep=sleeps,
    )
    assert await sink.write(b"x", 0, 1) is False
    assert sleeps.calls == [1.0, 2.0, 2.5]
    assert sink.failed_batches == 1 and sink.retries == 3
    await sink.close()


async def test_http_sink_does_not_retry_client_errors() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(400)

    sink = HttpSink(
        "http://c/e",
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        sleep=Sleeps(),
    )
    assert await sink.write(b"x", 0, 1) is False and calls == 1
    await sink.close()


async def test_slow_sink_never_blocks_the_ring() -> None:
    release = asyncio.Event()

    class SlowSink:
        async def write(self, payload: bytes, flags: int, count: int) -> bool:
            await release.wait()
            return True

        async def close(self) -> None:
            return None

    ring = EventRing(50)
    shipper = EventShipper(ring, SlowSink(), batch_size=10, flush_interval=0.01)
    shipper.start()
    for i in range(500):
        ring.push(_event(i))  # never waits
        if i % 50 == 0:
            await asyncio.sleep(0)
    assert ring.dropped > 0 and len(ring) == 50
    release.set()
    await shipper.stop()
    assert shipper.shipped + ring.dropped == 500


async def test_subscription_is_bounded_and_filtered() -> None:
    closed: list[Subscription] = []
    sub = Subscription(make_predicate({"client_id": "c1"}), 3, closed.append)
    for i in range(30):
        sub.offer(event_dict(_event(i)))
    assert sub.qsize() == 3 and sub.dropped == 7  # 10 matched, 3 kept
    first = await sub.get()
    assert first["client_id"] == "c1" and first["queue_us"] == 22
    assert sub.get_nowait()["queue_us"] == 25
    assert sub.get_nowait()["queue_us"] == 28
    waiter = asyncio.create_task(sub.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    sub.offer(event_dict(_event(31)))
    assert (await waiter)["queue_us"] == 31
    sub.close()
    assert closed == [sub]
    with pytest.raises(asyncio.QueueEmpty):
        sub.get_nowait()


def test_predicate_specs() -> None:
    slow = make_predicate({"min_total_us": 150, "errors_only": True})
    assert slow is not None
    assert not slow(event_dict(_event(10)))  # error but fast (121 µs)
    assert slow(event_dict(_event(50)))  # error and 201 µs
    with pytest.raises(ValueError):
        make_predicate({"nope": 1})


# --------------------------------------------------------------------------- #
# Blocks, the block ring, the hand-laid batch map, batched writes
# --------------------------------------------------------------------------- #


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=2**31 - 1),
    strings=st.binary(max_size=3_000),
    columns=st.one_of(st.binary(max_size=3_000), st.just(b"\x07" * 70_000)),
)
def test_batch_map_reads_back_like_the_library_encoder(
    n: int, strings: bytes, columns: bytes
) -> None:
    """The batch map scry lays out itself reads back, with the flatbuffers
    package's own reader, exactly like what its encoder makes of the same map."""
    mine = flexbuffers.Loads(_batch_map(n, strings, columns))
    library = flexbuffers.Loads(
        bytes(
            flexbuffers.Dumps(
                {"v": 1, "n": n, "layout": LAYOUT, "strings": strings, "columns": columns}
            )
        )
    )
    assert mine == library
    assert bytes(mine["strings"]) == strings and bytes(mine["columns"]) == columns


def test_block_and_tuple_batches_encode_the_same() -> None:
    events = [_event(i) for i in range(30)]
    block = EventBlock.of_events(events)
    assert block.rows() == events and len(block) == 30
    for compression in ("gzip", "none"):
        from_block = decode_batch(*encode_batch(block, compression))
        assert from_block == decode_batch(*encode_batch(events, compression))
        assert from_block == [event_dict(e) for e in events]
    assert decode_batch(*encode_batch([], "none")) == []


def test_array_columns_encode_and_join_as_lists_do() -> None:
    """The drain hands numbers over as arrays in the batch's own types; the
    ring joins them across blocks and the encoder copies their bytes."""
    events = [_event(i) for i in range(30)]
    as_lists = EventBlock.of_events(events)
    numbers = {"ts": "d", "queue_us": "q", "pool_acquire_us": "q", "backend_us": "q",
               "total_us": "q", "rows": "q"}  # fmt: skip
    columns = [
        array(numbers[name], column) if name in numbers else list(column)
        for name, column in zip(EVENT_FIELDS, as_lists.columns, strict=True)
    ]
    as_arrays = EventBlock(columns, 30)
    ring = EventRing(100)
    ring.extend(as_arrays.slice(0, 10))
    ring.extend(as_arrays.slice(10, 30))
    joined = ring.take_block(25)
    assert isinstance(joined.columns[0], array) and joined.rows() == events[:25]
    assert encode_batch(as_arrays, "none") == encode_batch(as_lists, "none")
    assert decode_batch(*encode_batch(as_arrays, "gzip")) == [event_dict(e) for e in events]
    assert decode_batch(*encode_batch(joined, "none")) == [event_dict(e) for e in events[:25]]


_NUMBER_TYPES = {"ts": "d", "queue_us": "q", "pool_acquire_us": "q", "backend_us": "q",
                 "total_us": "q", "rows": "q"}  # fmt: skip
_CODES = events_module._LAYOUT_CODES


def _as_drained(block: EventBlock) -> list:
    """The block's columns as the drain builds them: numbers in arrays."""
    return [
        array(_NUMBER_TYPES[name], column) if name in _NUMBER_TYPES else list(column)
        for name, column in zip(EVENT_FIELDS, block.columns, strict=True)
    ]


event_st = st.builds(
    _event,
    st.integers(0, 1_000),
    client_id=st.sampled_from(["c1", "c2", "ü", "\udcff"]),
    database=st.sampled_from(["db", "other"]),
    query=st.text(st.characters(exclude_characters="\0"), max_size=20),  # (NUL ends a string)
    sqlstate=st.sampled_from([None, "57014", "42P01"]),
    pin_reasons=st.sampled_from([(), ("set",), ("prepare", "temp_table")]),
    rows=st.integers(0, 2**63 - 1),
    worker=st.integers(-(2**31), 2**31 - 1),
)


@pytest.mark.skipif(
    events_module._compiled_encode_columns is None, reason="the extension was not built"
)
@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.lists(event_st, min_size=1, max_size=12), min_size=1, max_size=4),
    cuts=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=4, max_size=4),
    arrays=st.booleans(),
)
def test_compiled_encoder_says_what_the_python_one_says(
    blocks: list[list[tuple]], cuts: list[tuple[int, int]], arrays: bool
) -> None:
    parts = []
    for events, (a, b) in zip(blocks, cuts, strict=False):
        block = EventBlock.of_events(events)
        columns = _as_drained(block) if arrays else block.columns
        start, stop = sorted((min(a, len(events)), min(b, len(events))))
        parts.append((columns, start, stop))
    compiled = events_module._compiled_encode_columns(parts, _CODES)
    assert compiled == events_module.py_encode_columns(parts, _CODES)
    expected = [e for events, (_, start, stop) in zip(blocks, parts, strict=False)
                for e in events[start:stop]]  # fmt: skip
    assert decode_batch(*encode_parts(parts, "gzip")) == [event_dict(e) for e in expected]


@pytest.mark.skipif(
    events_module._compiled_encode_columns is None, reason="the extension was not built"
)
def test_compiled_encoder_refuses_what_it_cannot_encode_as_the_twin_does() -> None:
    compiled = events_module._compiled_encode_columns
    too_big = EventBlock.of_events([_event(1, worker=2**31)])
    not_a_number = EventBlock.of_events([_event(1, rows="7")])
    for block in (too_big, not_a_number):
        parts = [(block.columns, 0, 1)]
        with pytest.raises((OverflowError, TypeError)):
            compiled(parts, _CODES)
        with pytest.raises((OverflowError, TypeError)):
            encode_parts(parts)  # the twin raises the same kind of error
    with pytest.raises(ValueError):
        compiled([(too_big.columns, 0, 2)], _CODES)  # past the block's end
    not_strings = EventBlock.of_events([_event(1, database=5)])
    with pytest.raises(TypeError):
        compiled([(not_strings.columns, 0, 1)], _CODES)


def test_ring_parts_are_slices_of_its_blocks_and_encode_as_blocks_do() -> None:
    events = [_event(i) for i in range(30)]
    drained = _as_drained(EventBlock.of_events(events))
    ring = EventRing(100)
    ring.extend(EventBlock([c[:12] for c in drained], 12))
    ring.extend(EventBlock([c[12:] for c in drained], 18))
    first = ring.take_parts(10)
    assert [(start, stop) for _, start, stop in first] == [(0, 10)]
    spanning = ring.take_parts(10)  # the rest of the first block, then the second
    assert [(start, stop) for _, start, stop in spanning] == [(10, 12), (0, 8)]
    assert len(ring) == 10
    assert encode_parts(spanning, "none") == encode_batch(events[10:20], "none")
    assert decode_batch(*encode_parts(first)) == [event_dict(e) for e in events[:10]]
    assert ring.take_parts(0) == [] and len(ring.take_parts(100)) == 1 and not ring


def test_block_ring_drops_and_takes_across_blocks() -> None:
    ring = EventRing(7)
    ring.extend(EventBlock.of_events([(i,) for i in range(4)]))
    ring.extend([(i,) for i in range(4, 6)])
    ring.push((6,))
    assert len(ring) == 7 and ring.dropped == 0
    ring.extend(EventBlock.of_events([(i,) for i in range(7, 12)]))  # drops 0..4
    assert ring.pushed == 12 and ring.dropped == 5 and len(ring) == 7
    first = ring.take_block(3)
    assert first.rows() == [(5,), (6,), (7,)] and len(ring) == 4
    assert ring.take(10) == [(8,), (9,), (10,), (11,)]
    assert len(ring) == 0 and ring.take_block(5).rows() == []
    ring.extend(EventBlock.of_events([(i,) for i in range(20)]))  # one block over capacity
    assert ring.take(100) == [(i,) for i in range(13, 20)] and ring.dropped == 18


class CountingFileSink(FileSink):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.calls: list[int] = []

    def write_batches(self, payloads: list[bytes], compression: str) -> None:
        self.calls.append(len(payloads))
        super().write_batches(payloads, compression)


async def test_shipper_hands_ready_batches_over_in_one_write(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    sink = CountingFileSink(path)
    flushed: list[tuple[int, bool]] = []
    nine_flushed, all_flushed = asyncio.Event(), asyncio.Event()

    def on_flush(count: int, seconds: float, ok: bool) -> None:
        flushed.append((count, ok))
        if len(flushed) == 9:
            nine_flushed.set()
        if len(flushed) == 10:
            all_flushed.set()

    ring = EventRing(10_000)
    shipper = EventShipper(ring, sink, batch_size=10, flush_interval=0.5, on_flush=on_flush)
    ring.extend(EventBlock.of_events([_event(i) for i in range(95)]))
    shipper.start()
    shipper.notify()
    await asyncio.wait_for(nine_flushed.wait(), 5)
    # The nine full batches went in one write; the last five wait for the interval.
    assert sink.calls == [9] and shipper.shipped == 90 and len(ring) == 5
    await asyncio.wait_for(all_flushed.wait(), 5)
    assert shipper.shipped == 95 and shipper.batches == 10
    await shipper.stop()
    assert flushed == [(10, True)] * 9 + [(5, True)]
    # Two frames: the nine batches compressed together, then the last one.
    data = path.read_bytes()
    _, _, flags, _, length = HEADER.unpack_from(data)
    assert flags == FLAG_GZIP | FLAG_BATCHES
    assert len(frame_payloads(data[HEADER.size : HEADER.size + length], flags)) == 9
    _, _, flags, _, _ = HEADER.unpack_from(data, HEADER.size + length)
    assert flags == FLAG_GZIP
    events = list(read_events(path))
    assert [e["queue_us"] for e in events] == list(range(95))


async def test_shipper_lingers_until_a_full_trip_is_waiting(tmp_path: Path) -> None:
    sink = CountingFileSink(tmp_path / "events.log")
    flushed = asyncio.Event()

    def on_flush(count: int, seconds: float, ok: bool) -> None:
        flushed.set()

    ring = EventRing(10_000)
    shipper = EventShipper(
        ring, sink, batch_size=10, flush_interval=30, linger=30, on_flush=on_flush
    )
    assert shipper._backlog == 160  # 16 batches
    shipper.start()
    ring.extend(EventBlock.of_events([_event(i) for i in range(10)]))
    shipper.notify()
    await asyncio.wait_for(flushed.wait(), 5)
    assert sink.calls == [1]  # the first full batch goes at once
    flushed.clear()
    ring.extend(EventBlock.of_events([_event(i) for i in range(10, 160)]))
    shipper.notify()  # 15 batches: it lingers on
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(flushed.wait(), 0.2)
    ring.extend(EventBlock.of_events([_event(i) for i in range(160, 170)]))
    shipper.notify()  # a full trip of 16
    await asyncio.wait_for(flushed.wait(), 5)
    assert sink.calls == [1, 16] and shipper.shipped == 170
    await shipper.stop()
    assert [e["queue_us"] for e in read_events(tmp_path / "events.log")] == list(range(170))


async def test_shipper_ships_what_gathered_at_the_first_notify_after_the_linger(
    tmp_path: Path,
) -> None:
    """The linger ends at the drain's next notify once its time has passed:
    the shipper has no timer of its own for it."""
    sink = CountingFileSink(tmp_path / "events.log")
    trips: list[int] = []
    first, third = asyncio.Event(), asyncio.Event()

    def on_flush(count: int, seconds: float, ok: bool) -> None:
        trips.append(count)
        (first if len(trips) == 1 else third if len(trips) == 3 else asyncio.Event()).set()

    now = [100.0]
    ring = EventRing(100)  # a small ring: it lingers only until half of it waits
    shipper = EventShipper(
        ring,
        sink,
        batch_size=10,
        flush_interval=30,
        linger=0.05,
        on_flush=on_flush,
        clock=lambda: now[0],
    )
    assert shipper._backlog == 50
    shipper.start()
    ring.extend(EventBlock.of_events([_event(i) for i in range(10)]))
    shipper.notify()
    await asyncio.wait_for(first.wait(), 5)
    ring.extend(EventBlock.of_events([_event(i) for i in range(10, 30)]))
    shipper.notify()  # two batches, below the backlog, within the linger: they wait
    for _ in range(20):
        await asyncio.sleep(0)
    assert trips == [10]
    now[0] += 0.05
    shipper.notify()  # the next drain, the linger over: one trip for both
    await asyncio.wait_for(third.wait(), 5)
    assert sink.calls == [1, 2] and trips == [10, 10, 10] and ring.dropped == 0
    await shipper.stop()


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_frame_batches_roundtrip_and_bad_lengths(compression: str) -> None:
    payloads = [encode_batch([_event(i) for i in range(n)], "none")[0] for n in (1, 3, 2)]
    data = frame_batches(payloads, compression)
    _, _, flags, _, length = HEADER.unpack_from(data)
    assert flags & FLAG_BATCHES and len(data) == HEADER.size + length
    assert frame_payloads(data[HEADER.size :], flags) == payloads
    single = frame_batches(payloads[:1], compression)
    assert not HEADER.unpack_from(single)[2] & FLAG_BATCHES
    assert frame_payloads(single[HEADER.size :], HEADER.unpack_from(single)[2]) == payloads[:1]
    packed = b"".join(len(p).to_bytes(4, "little") + p for p in payloads)
    with pytest.raises(ValueError, match="past the end"):
        frame_payloads(packed[:-1], FLAG_BATCHES)
