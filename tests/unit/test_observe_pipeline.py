"""The Observatory end to end with synthetic records (no database)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from scry.config import ObservabilityConfig
from scry.observe.events import read_events
from scry.observe.pipeline import Observatory
from scry.observe.record import ClientContext

SECRET_ID = 987654321
SECRET_NAME = "Cnry-Alice-Secret"


class Clocks:
    """A wall clock and a perf_counter_ns that move together."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000.0
        self.ns = 5_000_000_000

    def clock(self) -> float:
        return self.wall

    def perf_ns(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.ns += int(seconds * 1e9)


def _record(clocks: Clocks, ctx: ClientContext, text: str, total_us: int, **kw: object) -> tuple:
    done = clocks.ns
    received = done - total_us * 1000
    acquired = received + int(kw.get("queue_us", 0)) * 1000
    return (
        ctx,
        text.encode(),
        received,
        acquired,
        acquired,
        done,
        kw.get("rows", 1),
        kw.get("sqlstate"),
        kw.get("pins"),
    )


def _observatory(clocks: Clocks, **config: object) -> Observatory:
    return Observatory(
        ObservabilityConfig(anonymize_key="test", **config),
        clock=clocks.clock,
        perf_counter_ns=clocks.perf_ns,
    )


def _feed(obs: Observatory, clocks: Clocks) -> None:
    app = ClientContext("c1", "shop", "app", "web", worker=2)
    batch = ClientContext("c2", "reports", "batch", "etl", worker=2)
    for i in range(200):
        obs.record(
            _record(
                clocks, app, f"SELECT * FROM users WHERE id = {SECRET_ID if i % 4 == 0 else i}", 500
            )
        )
    for i in range(20):
        obs.record(
            _record(
                clocks,
                batch,
                f"UPDATE orders SET note = '{SECRET_NAME}' WHERE customer IN ({i}, {SECRET_ID})",
                20_000,
                queue_us=300,
                rows=3,
                pins=("set",),
            )
        )
    obs.record(_record(clocks, app, "SELEC oops 'x'", 100, sqlstate="42601"))


def test_end_to_end_top_hot_summary_metrics() -> None:
    clocks = Clocks()
    obs = _observatory(clocks)
    _feed(obs, clocks)
    assert obs.drain() == 221
    top = obs.top("total_time", 10)
    assert top[0]["query"] == "UPDATE orders SET note = $1 WHERE customer IN ($2, ...)"
    assert top[0]["calls"] == 20 and top[0]["rows"] == 60
    assert top[0]["queue_ms_mean"] == 0.3 and top[0]["total_ms"] == 400
    assert top[1]["query"] == "SELECT * FROM users WHERE id = $1" and top[1]["calls"] == 200
    assert abs(top[0]["share"] + top[1]["share"] + top[2]["share"] - 1) < 1e-9
    assert obs.top("errors", 1)[0]["errors"] == 1
    assert obs.top("calls", 5, window_seconds=60)[0]["calls"] == 200

    hot = obs.hot(5)
    assert {t["table"] for t in hot["tables"]} == {"users", "orders"}
    assert hot["tables"][0] == {"table": "users", "count": 200}
    assert hot["values"][0]["column"] == "users.id" and hot["values"][0]["count"] >= 50
    assert any(v["column"] == "orders.customer" for v in obs.hot(50)["values"])

    summary = obs.stats_summary()
    assert summary["queries"] == 221 and summary["errors"] == 1
    assert summary["qps"] > 0 and summary["p99_ms"] > 0
    assert summary["events_dropped"] == 0 and summary["evicted_fingerprints"] == 0

    text = obs.metrics_text()
    assert 'scry_database_query_duration_seconds_count{database="shop"} 201.0' in text
    assert "scry_query_duration_seconds_count 221.0" in text
    assert 'scry_pinned_queries_total{reason="set"} 20.0' in text
    assert 'scry_query_errors_total{database="shop"} 1.0' in text
    assert all(row["fingerprint"] not in text for row in top)  # never a per-fingerprint label

    for output in (json.dumps(top), json.dumps(hot), json.dumps(summary), text):
        assert str(SECRET_ID) not in output and SECRET_NAME not in output


def test_pool_provider_and_breaker_metrics() -> None:
    obs = _observatory(Clocks())
    obs.metrics.set_pool_stats_provider(
        lambda: [
            dict(
                database="shop",
                user="app",
                size=20,
                active=15,
                idle=5,
                waiting=3,
                max_wait_seconds=0.25,
            )
        ]
    )
    obs.metrics.breaker_state.labels(database="shop").set(2)
    obs.metrics.breaker_transitions_total.labels(
        database="shop", from_state="closed", to_state="open"
    ).inc()
    text = obs.metrics_text()
    assert 'scry_pool_saturation{database="shop",user="app"} 0.75' in text
    assert 'scry_pool_max_wait_seconds{database="shop",user="app"} 0.25' in text
    assert 'scry_breaker_state{database="shop"} 2.0' in text
    assert (
        'scry_breaker_transitions_total{database="shop",from_state="closed",to_state="open"} 1.0'
        in text
    )


async def test_events_and_tail_are_anonymized(tmp_path: Path) -> None:
    clocks = Clocks()
    path = tmp_path / "events.log"
    obs = Observatory(
        ObservabilityConfig(
            anonymize_key="test",
            events={"sink": "file", "path": str(path), "batch_size": 50, "flush_interval_ms": 20},
        ),
        clock=clocks.clock,
        perf_counter_ns=clocks.perf_ns,
        drain_max_wait=0.01,
    )
    tail = obs.subscribe({"database": "reports"}, maxsize=5)
    await obs.start()
    _feed(obs, clocks)
    await asyncio.sleep(0.1)
    await obs.stop()
    events = list(read_events(path))
    assert len(events) == 221
    update = next(e for e in events if e["database"] == "reports")
    assert update["query"] == "UPDATE orders SET note = $1 WHERE customer IN ($2, ...)"
    assert update["pinned"] is True and update["pin_reasons"] == ["set"]
    assert update["queue_us"] == 300 and update["total_us"] == 20_000 and update["rows"] == 3
    assert (
        update["worker"] == 2 and update["user"] == "batch" and update["application_name"] == "etl"
    )
    assert abs(update["ts"] - clocks.wall) < 1
    assert events[-1]["sqlstate"] == "42601"
    assert tail.qsize() == 5 and tail.dropped == 15
    tailed = [tail.get_nowait() for _ in range(5)]
    dump = path.read_bytes().decode("latin-1") + json.dumps(events) + json.dumps(tailed)
    assert str(SECRET_ID) not in dump and SECRET_NAME not in dump


def test_without_anonymization_events_carry_raw_text() -> None:
    clocks = Clocks()
    obs = _observatory(clocks, anonymize=False)
    tail = obs.subscribe()
    obs.record(
        _record(clocks, ClientContext("c", "d", "u", "a"), "SELECT 1 FROM t WHERE id = 77", 10)
    )
    obs.drain()
    assert tail.get_nowait()["query"] == "SELECT 1 FROM t WHERE id = 77"
    assert "77" not in json.dumps(obs.hot())  # hot values are always keyed hashes


def test_fingerprinting_off_computes_nothing() -> None:
    clocks = Clocks()
    obs = _observatory(clocks, fingerprinting=False)
    _feed(obs, clocks)
    assert obs.drain() == 0
    assert obs.top() == [] and obs.stats_summary()["queries"] == 0


def test_record_queue_is_bounded_and_counts_drops() -> None:
    clocks = Clocks()
    obs = Observatory(
        ObservabilityConfig(), max_records=10, clock=clocks.clock, perf_counter_ns=clocks.perf_ns
    )
    ctx = ClientContext("c", "d", "u", "a")
    for i in range(25):
        obs.record(_record(clocks, ctx, f"SELECT {i}", 10))
    assert obs.records_dropped == 15 and obs.drain() == 10
    assert obs.records_dropped == 15 and obs.stats_summary()["records_pending"] == 0
    assert obs.stats.summary()["queries"] == 10
    # Memory stays bounded even if the drain stopped (drops past that bound
    # are no longer counted).
    stalled = Observatory(ObservabilityConfig(), max_records=10, drain_chunk=2)
    for i in range(100):
        stalled.record(_record(clocks, ctx, f"SELECT {i}", 10))
    assert len(stalled.queue) == 30 and stalled.records_dropped == 20


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def _drained_at(clocks: Clocks, drain_at: int, drain_max_wait: float) -> Observatory:
    return Observatory(
        ObservabilityConfig(),
        clock=clocks.clock,
        perf_counter_ns=clocks.perf_ns,
        drain_at=drain_at,
        drain_max_wait=drain_max_wait,
    )


async def test_the_drain_waits_for_drain_at_records_then_is_woken() -> None:
    """Fewer than drain_at records wait; wake_drain (which the server calls
    when it queues the drain_at-th) has them drained at once, long before
    drain_max_wait."""
    clocks = Clocks()
    obs = _drained_at(clocks, drain_at=5, drain_max_wait=3600)
    ctx = ClientContext("c", "d", "u", "a")
    await obs.start()
    try:
        for i in range(4):
            obs.record(_record(clocks, ctx, f"SELECT {i}", 10))
        for _ in range(10):  # the drain task gets its turns, and waits on
            await asyncio.sleep(0)
        assert obs.records_processed == 0
        obs.record(_record(clocks, ctx, "SELECT 4", 10))
        obs.wake_drain()
        await _until(lambda: obs.records_processed == 5)
        obs.wake_drain()  # with nothing queued: the drain finds nothing, waits again
        for _ in range(10):
            await asyncio.sleep(0)
        for i in range(5, 10):
            obs.record(_record(clocks, ctx, f"SELECT {i}", 10))
        obs.wake_drain()
        await _until(lambda: obs.records_processed == 10)
    finally:
        await obs.stop()


async def test_a_lone_record_is_drained_after_drain_max_wait() -> None:
    clocks = Clocks()
    obs = _drained_at(clocks, drain_at=1000, drain_max_wait=0.01)
    await obs.start()
    try:
        obs.record(_record(clocks, ClientContext("c", "d", "u", "a"), "SELECT 1", 10))
        await _until(lambda: obs.records_processed == 1)
    finally:
        await obs.stop()


def test_max_fingerprints_evicts() -> None:
    clocks = Clocks()
    obs = _observatory(clocks, max_fingerprints=3)
    ctx = ClientContext("c", "d", "u", "a")
    for table in "abcdef":
        obs.record(_record(clocks, ctx, f"SELECT * FROM {table}", 10))
    obs.drain()
    assert len(obs.top("calls", 10)) == 3
    assert obs.stats_summary()["evicted_fingerprints"] == 3
    assert "scry_fingerprints_evicted_total 3.0" in obs.metrics_text()


def test_a_bad_record_does_not_stop_the_drain() -> None:
    clocks = Clocks()
    obs = _observatory(clocks)
    obs.record(("not", "a", "record"))  # type: ignore[arg-type]
    obs.record(_record(clocks, ClientContext("c", "d", "u", "a"), "SELECT 1", 10))
    assert obs.drain() == 2
    assert obs.record_failures == 1 and obs.stats_summary()["queries"] == 1


def test_session_state_listeners_hear_each_shape_with_effects() -> None:
    # Off the query path: a shape is classified once; listeners get the
    # contexts of the statements with effects that succeeded, nothing else.
    clocks = Clocks()
    obs = _observatory(clocks)
    heard: list[tuple[tuple[str, ...], list[str]]] = []
    obs.session_state_listeners.append(
        lambda effects, contexts: heard.append(
            (tuple(e.reason for e in effects), [c.client_id for c in contexts])
        )
    )
    a, b, c = (ClientContext(name, "d", "u", "app") for name in ("a", "b", "c"))
    for ctx, text, sqlstate in [
        (a, "SELECT 1 FROM t WHERE id = 1", None),
        (b, "SET search_path = 's1'", None),
        (c, "SET search_path = 's2'", "42704"),
        (a, "SET search_path = 's3'", None),
        (c, "SELECT pg_advisory_lock(7)", None),
    ]:
        obs.record(_record(clocks, ctx, text, 10, sqlstate=sqlstate))
    obs.drain()
    assert sorted(heard) == [(("advisory_lock",), ["c"]), (("set",), ["b", "a"])]
    obs.record(_record(clocks, a, "SELECT 2 FROM t WHERE id = 2", 10))
    obs.drain()
    assert len(heard) == 2  # a shape without effects: nothing


def test_chunked_drain_equals_per_record_accounting() -> None:
    """The drain sums up per shape and per database; the result must be what
    counting every record on its own gives (StatsTable.add, observe_query)."""
    import random

    from scry.observe.metrics import ObserveMetrics
    from scry.observe.stats import StatsTable

    clocks = Clocks()
    obs = _observatory(clocks)
    heard: list[tuple[str, int, str | None]] = []
    obs.query_listeners.append(lambda *args: heard.append(args))
    heard_in_batches: list[tuple[str, int, str | None]] = []

    def batch_listener(database: str, totals: list[int], sqlstates: list[str | None]) -> None:
        assert len(totals) == len(sqlstates)
        heard_in_batches.extend(
            (database, t // 1000, s) for t, s in zip(totals, sqlstates, strict=True)
        )

    obs.query_batch_listeners.append(batch_listener)
    reference_stats = StatsTable(obs.config.max_fingerprints, clock=clocks.clock)
    reference_metrics = ObserveMetrics()
    contexts = [ClientContext(f"c{i}", db, "u", "a") for i, db in enumerate(["d1", "d2", "d1"])]
    rng = random.Random(5)
    texts = [
        "SELECT * FROM users WHERE id = {}",
        "UPDATE t SET x = 1 WHERE id IN ({}, 2)",
        "SELECT 1",
    ]
    expected_heard = []
    for i in range(3_000):
        clocks.advance(0.004)  # 12 s in all: crosses stats slots between drains and within
        ctx = contexts[i % 3]
        template = texts[rng.randrange(3)]
        total_us = int(rng.expovariate(1 / 2_000))
        queue_us = rng.choice((0, 0, 150))
        sqlstate = "57014" if i % 97 == 0 else None
        pins = ("set",) if i % 50 == 0 else None
        rec = list(_record(clocks, ctx, template.format(i) + "\0", total_us, queue_us=queue_us))
        rec[6], rec[7], rec[8] = b"SELECT 3\0", sqlstate, pins
        obs.record(tuple(rec))  # type: ignore[arg-type]
        shape = obs.fingerprinter.fingerprint(template.format(i))
        ts = rec[5] / 1e9 + obs._wall_offset
        reference_stats.add(
            shape.fingerprint, shape.normalized, ts, total_us, queue_us, total_us - queue_us,
            3, sqlstate is not None,
        )  # fmt: skip
        reference_metrics.observe_query(
            ctx.database, total_us, queue_us, 0, total_us - queue_us, sqlstate is not None, pins
        )
        expected_heard.append((ctx.database, total_us, sqlstate))
        if i % 700 == 0:
            obs.drain()
    obs.drain()
    assert obs.record_failures == 0
    for window in (None, 5, 60):
        assert obs.stats.top("calls", 10, window) == reference_stats.top("calls", 10, window)
    assert obs.stats.summary() == reference_stats.summary()
    assert sorted(heard, key=repr) == sorted(expected_heard, key=repr)
    assert sorted(heard_in_batches, key=repr) == sorted(expected_heard, key=repr)
    mine, theirs = obs.metrics_text().splitlines(), reference_metrics.text().decode().splitlines()
    wanted = ("scry_database_query", "scry_query_", "scry_pinned", "scry_queries")
    assert [line for line in mine if line.startswith(wanted)] == [
        line for line in theirs if line.startswith(wanted)
    ]


def test_batch_listeners_hear_each_latency_once_when_shapes_share_a_database() -> None:
    """Each group's latencies are handed over in record order, beside their
    sqlstates; the drain's per-database lists grow from a copy of the first
    group's, which must not reach the listeners twice."""
    clocks = Clocks()
    obs = _observatory(clocks)
    heard: list[tuple[str, list[int], list[str | None]]] = []
    obs.query_batch_listeners.append(
        lambda database, totals, sqlstates: heard.append((database, list(totals), list(sqlstates)))
    )
    ctx = ClientContext("c1", "shop", "app", "web")
    latencies = {
        "SELECT * FROM a WHERE id = {}": [9, 3, 7],
        "SELECT * FROM b WHERE id = {}": [5, 1],
    }
    for template, totals in latencies.items():
        for i, total_us in enumerate(totals):
            clocks.advance(0.001)
            obs.record(_record(clocks, ctx, template.format(i) + "\0", total_us))
    obs.drain()
    assert [(database, sqlstates) for database, _, sqlstates in heard] == [
        ("shop", [None] * 3),
        ("shop", [None] * 2),
    ]
    assert [totals for _, totals, _ in heard] == [[9_000, 3_000, 7_000], [5_000, 1_000]]


def test_event_ring_extend_counts_drops() -> None:
    from scry.observe.events import EventRing

    ring = EventRing(5)
    ring.extend([(i,) for i in range(3)])
    ring.extend([(i,) for i in range(3, 10)])
    assert ring.pushed == 10 and ring.dropped == 5 and ring.take(10) == [(i,) for i in range(5, 10)]


@pytest.mark.parametrize("tables", [2, 1])  # several variants in a chunk, or one
def test_event_columns_match_per_record_events(tables: int) -> None:
    """The drain builds events column-wise; each must be what the record says."""
    import random

    clocks = Clocks()
    for anonymize in (True, False):
        obs = _observatory(clocks, anonymize=anonymize)
        tail = obs.subscribe(maxsize=10_000)
        contexts = [ClientContext(f"c{i}", f"db{i % 2}", "u", "a", worker=i) for i in range(3)]
        rng = random.Random(3)
        records = []
        for i in range(300):
            clocks.advance(0.001)
            rec = list(_record(clocks, contexts[i % 3], f"SELECT * FROM t{i % tables} WHERE id = {i}",
                               rng.randrange(50, 5_000), queue_us=rng.choice((0, 70))))  # fmt: skip
            rec[4] += rng.choice((0, 0, 3_000))  # sent after acquired now and then
            rec[6] = b"SELECT 2\0" if i % 4 else 5
            rec[7] = "40001" if i % 13 == 0 else None
            rec[8] = ("set", "prepare") if i % 17 == 0 else (() if i % 19 == 0 else None)
            records.append(tuple(rec))
            obs.record(tuple(rec))  # type: ignore[arg-type]
        obs.drain()
        got = [tail.get_nowait() for _ in range(tail.qsize())]
        expected = []
        for ctx, text, received, acquired, sent, done, tag, sqlstate, pins in records:
            shape = obs.fingerprinter.fingerprint(text)
            expected.append({
                "ts": done / 1e9 + obs._wall_offset, "worker": ctx.worker,
                "client_id": ctx.client_id, "database": ctx.database, "user": ctx.user,
                "application_name": ctx.application_name, "fingerprint": shape.fingerprint,
                "query": shape.normalized if anonymize else text.decode(),
                "queue_us": (acquired - received) // 1000,
                "pool_acquire_us": (sent - acquired) // 1000, "backend_us": (done - sent) // 1000,
                "total_us": (done - received) // 1000, "rows": 2 if isinstance(tag, bytes) else 5,
                "sqlstate": sqlstate, "pinned": pins is not None, "pin_reasons": list(pins or ()),
            })  # fmt: skip
        assert got == expected
