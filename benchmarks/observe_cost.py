"""Micro-benchmark of the observability drain: µs of CPU per query record, no sockets.

Feeds records shaped the way the proxy builds them (a simple-protocol Query
body keeps its trailing NUL, ``rows`` is the raw CommandComplete tag) through
``Observatory.record`` and ``Observatory.drain`` and prints the cost per record
for two workloads:

pgbench
    ``pgbench -S``: ``SELECT abalance FROM pgbench_accounts WHERE aid = N;``
    with a different ``N`` (1..1,000,000, scale 10) in nearly every record.
mixed
    the e-commerce mix of ``scry.workload`` (browse, product, search, history,
    order, checkout transactions, the occasional slow or failing query, and a
    session client's ``EXECUTE``/``SHOW``).

and three configurations: no event sink; an event sink (drain + ring, then
encoding and writing the batches to a file as the shipper does); and the
proxy's health listener fed per record::

    .venv/bin/python benchmarks/observe_cost.py [N]
    .venv/bin/python benchmarks/observe_cost.py --cold[=KIB]
    .venv/bin/python -m cProfile -s tottime benchmarks/observe_cost.py | head -40

``--cold`` instead times single drains of the pgbench records, chunks of
several sizes, each drained right after the CPU caches were evicted (as the
relay, the kernel and PostgreSQL evict them live between two drains) and
each record a fresh object the drain frees, as the relay's are; the median
per drain splits into a fixed part and a part per record. With events, the
chunk's events are also encoded (not compressed or written).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from steps import DEFAULT_COLD_KIB, CacheEvictor  # type: ignore[import-not-found]

from scry import workload
from scry.config import ObservabilityConfig
from scry.health import HealthMonitor
from scry.observe.events import encode_batch, serialize_parts
from scry.observe.pipeline import Observatory
from scry.observe.record import ClientContext
from scry.observe.sinks import FileSink

PGBENCH = b"SELECT abalance FROM pgbench_accounts WHERE aid = %d;"
DRAIN_CHUNK = 1_000  # Observatory.drain_chunk
BATCH_SIZE = 100  # events.batch_size


def _contexts(n: int, database: str, app: str) -> list[ClientContext]:
    return [ClientContext(f"c{i}", database, "bench", app) for i in range(n)]


def pgbench_records(n: int) -> list[tuple]:
    ctxs = _contexts(50, "bench", "pgbench")
    rng = random.Random(1)
    now = time.perf_counter_ns()
    out = []
    for i in range(n):
        t0 = now + i * 50_000
        text = PGBENCH % rng.randrange(1, 1_000_001) + b"\x00"
        total = 40_000 + int(rng.expovariate(1 / 30_000))
        queue = 500 + rng.randrange(2_000)
        out.append(
            (
                ctxs[i % 50],
                text,
                t0,
                t0 + queue,
                t0 + queue,
                t0 + total,
                b"SELECT 1\x00",
                None,
                None,
            )
        )
    return out


def _mixed_texts(rng: random.Random) -> list[tuple[bytes, bytes, str | None]]:
    """One client turn: [(text, CommandComplete tag, sqlstate)]."""
    kinds = list(workload.MIX)
    weights = [workload.MIX[k] for k in kinds]
    kind = workload._choose_kind(rng, kinds, weights)
    if kind == "checkout":
        cid = workload._hot_id(rng, workload.CUSTOMERS)
        oid = rng.randrange(10_000, 99_999)
        items = sorted(
            (workload._hot_id(rng, workload.PRODUCTS), rng.randint(1, 3))
            for _ in range(rng.randint(1, 3))
        )
        values = ", ".join(
            f"({oid}, {line}, {pid}, {qty}, (SELECT price FROM products WHERE id = {pid}))"
            for line, (pid, qty) in enumerate(items, 1)
        )
        turn = [
            ("BEGIN", "BEGIN", None),
            (
                f"INSERT INTO orders (customer_id, created_at, status) VALUES ({cid}, now(), "
                "'pending') RETURNING id",
                "INSERT 0 1",
                None,
            ),
            (
                "INSERT INTO order_items (order_id, line, product_id, quantity, unit_price) "
                f"VALUES {values}",
                f"INSERT 0 {len(items)}",
                None,
            ),
            (
                "UPDATE orders SET total = (SELECT sum(quantity * unit_price) FROM order_items "
                f"WHERE order_id = {oid}) WHERE id = {oid}",
                "UPDATE 1",
                None,
            ),
            *(
                (
                    f"UPDATE products SET stock = greatest(stock - {qty}, 0) WHERE id = {pid}",
                    "UPDATE 1",
                    None,
                )  # fmt: skip
                for pid, qty in items
            ),
            ("COMMIT", "COMMIT", None),
        ]
    elif rng.random() < 0.05:  # the session client
        if rng.random() < 0.05:
            turn = [("SHOW statement_timeout", "SHOW", None)]
        else:
            pid = workload._hot_id(rng, workload.PRODUCTS)
            turn = [(f"EXECUTE demo_product({pid})", "SELECT 1", None)]
    else:
        text = workload._SQL[kind](rng)
        sqlstate = None
        tag = f"SELECT {rng.choice((1, 10, 20))}"
        if kind == "error":
            sqlstate = "42703" if text.startswith("SELECT") else "23505"
            tag = ""
        turn = [(text, tag, sqlstate)]
    return [(t.encode() + b"\x00", tag.encode() + b"\x00", s) for t, tag, s in turn]


def mixed_records(n: int) -> list[tuple]:
    ctxs = _contexts(8, "shop", "scry-demo")
    rng = random.Random(2)
    now = time.perf_counter_ns()
    out: list[tuple] = []
    while len(out) < n:
        ctx = ctxs[len(out) % len(ctxs)]
        for text, tag, sqlstate in _mixed_texts(rng):
            t0 = now + len(out) * 50_000
            total = 80_000 + int(rng.expovariate(1 / 200_000))
            queue = 500 + rng.randrange(2_000)
            out.append((ctx, text, t0, t0 + queue, t0 + queue, t0 + total, tag, sqlstate, None))
    return out[:n]


def best_of(fn: Callable[[], float], repeats: int = 5) -> float:
    return min(fn() for _ in range(repeats))


class _CountingSink:
    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        return True

    async def close(self) -> None:
        return None


def _drain_all(obs: Observatory, records: list[tuple]) -> float:
    """µs of CPU per record to drain ``records`` in drain-sized chunks."""
    obs.queue.extend(records)
    t = time.process_time()
    while obs.drain(DRAIN_CHUNK):
        pass
    return (time.process_time() - t) / len(records) * 1e6


def bench_workload(name: str, records: list[tuple], tmp: Path) -> None:
    n = len(records)
    print(f"{name}: {n} records")
    # Warm every shape once (their pglast parses are a one-off cost).
    plain = Observatory(ObservabilityConfig())
    _drain_all(plain, records)
    print(f"  drain, sink none               {best_of(lambda: _drain_all(plain, records)):6.2f} µs")

    with_events = Observatory(ObservabilityConfig(), sink=_CountingSink())
    _drain_all(with_events, records)
    sink = FileSink(tmp / f"{name}.events")

    def drain_and_ship() -> float:
        ring = with_events.ring
        ring.take_block(len(ring))
        with_events.queue.extend(records)
        t = time.process_time()
        while with_events.drain(DRAIN_CHUNK):
            # What the shipper does: batches of events.batch_size (100)
            # serialized here, then compressed together and written as one
            # frame in a worker thread (process_time counts both threads).
            raw = []
            while len(ring):
                raw.append(serialize_parts(ring.take_parts(BATCH_SIZE)))
            pool.submit(sink.write_batches, raw, "gzip").result()
        return (time.process_time() - t) / n * 1e6

    pool = ThreadPoolExecutor(1)

    def drain_events_only() -> float:
        with_events.ring.take_block(len(with_events.ring))
        return _drain_all(with_events, records)

    print(f"  drain + event into ring        {best_of(drain_events_only):6.2f} µs")
    print(f"  drain + events to a file sink  {best_of(drain_and_ship):6.2f} µs")

    listened = Observatory(ObservabilityConfig())
    monitors = {"bench": HealthMonitor(), "shop": HealthMonitor()}

    def feed_health(
        database: str, latencies_ns: Sequence[int], sqlstates: Sequence[str | None]
    ) -> None:
        # scry.proxy.Proxy._feed_health, without the proxy
        monitor = monitors.get(database)
        if monitor is not None:
            healthy = [t for t, s in zip(latencies_ns, sqlstates, strict=True) if s is None]
            monitor.observe_latencies(healthy, len(latencies_ns) - len(healthy))

    listened.query_batch_listeners.append(feed_health)
    _drain_all(listened, records)
    print(
        f"  drain + health listener        {best_of(lambda: _drain_all(listened, records)):6.2f} µs"
    )


def bench(n: int) -> None:
    pgbench = pgbench_records(n)
    obs = Observatory(ObservabilityConfig())
    obs.queue.clear()

    def record_only() -> float:
        obs.queue.clear()
        t = time.process_time()
        rec = obs.record
        for r in pgbench:
            rec(r)
        return (time.process_time() - t) / n * 1e6

    print(f"record() (hot path append)       {best_of(record_only):6.2f} µs")
    off = Observatory(ObservabilityConfig(fingerprinting=False))
    print(f"record(), fingerprinting off     {best_of(lambda: _time_calls(off, pgbench)):6.2f} µs")
    with tempfile.TemporaryDirectory() as tmp:
        bench_workload("pgbench", pgbench, Path(tmp))
        bench_workload("mixed", mixed_records(n), Path(tmp))
        for name, events in (("pgbench", pgbench[:500]), ("mixed", mixed_records(500))):
            drained = Observatory(ObservabilityConfig(), sink=_CountingSink())
            drained.queue.extend(events)
            drained.drain()
            block = drained.ring.take_block(500)
            for size in (BATCH_SIZE, 500):
                batch = block.slice(0, size)
                for compression in ("gzip", "none"):
                    t = time.process_time()
                    for _ in range(2_000 // size):
                        encode_batch(batch, compression)
                    per_event = (time.process_time() - t) / 2_000 * 1e6
                    print(
                        f"{name:7s} encode {size:3d}, {compression:4s}      "
                        f"{per_event:6.2f} µs per event"
                    )


def bench_cold(cold_kib: int) -> None:
    """Median CPU per drain of a chunk of pgbench records, caches evicted first."""
    evict = CacheEvictor(cold_kib)
    print(f"pgbench, one drain per chunk, caches evicted ({cold_kib} KiB) before each")
    for label, sink in (("no events", None), ("events encoded", _CountingSink())):
        for size in (50, 200, 700, 2_000):
            template = pgbench_records(size)
            rounds = max(20, 40_000 // size)
            # Fresh texts and timestamps per chunk (the drain frees them, as
            # it does the relay's), made before timing starts.
            chunks = [
                [(r[0], bytes(bytearray(r[1])), *(t + k for t in r[2:6]), *r[6:]) for r in template]
                for k in range(rounds)
            ]
            obs = Observatory(ObservabilityConfig(), sink=sink, drain_chunk=size)
            obs.queue.extend(pgbench_records(size))
            obs.drain()  # parse the shape once
            ring = obs.ring
            times = []
            # The relay's records are untracked tuples (no collection sees
            # them); these are not, so keep the collector out of the timing.
            gc.disable()
            try:
                for k in range(rounds):
                    obs.queue.extend(chunks[k])
                    chunks[k] = []
                    evict()
                    t = time.thread_time_ns()
                    obs.drain()
                    while len(ring):
                        serialize_parts(ring.take_parts(BATCH_SIZE))
                    times.append(time.thread_time_ns() - t)
            finally:
                gc.enable()
            median = sorted(times)[len(times) // 2] / 1e3
            print(
                f"  {label:14s} {size:5d} records  {median:7.1f} µs a drain  "
                f"{median / size:5.2f} µs a record"
            )


def _time_calls(obs: Observatory, records: list[tuple]) -> float:
    t = time.process_time()
    rec = obs.record
    for r in records:
        rec(r)
    return (time.process_time() - t) / len(records) * 1e6


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("records", nargs="?", type=int, default=50_000, help="records per run")
    parser.add_argument(
        "--cold",
        nargs="?",
        type=int,
        const=DEFAULT_COLD_KIB,
        default=0,
        metavar="KIB",
        help="time single drains with the caches evicted (KIB of memory written first)",
    )
    args = parser.parse_args()
    if args.cold:
        bench_cold(args.cold)
    else:
        bench(args.records)
    asyncio.run(asyncio.sleep(0))
