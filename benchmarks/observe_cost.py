"""Micro-benchmark of the observability drain: µs per query record, no sockets.

Feeds pgbench -S-like records (every text a different literal:
``SELECT abalance FROM pgbench_accounts WHERE aid = 4242;``) through
``Observatory.record`` and ``Observatory.drain`` and prints the cost of each
stage, plus the event path (ring + FlexBuffers/gzip encoding):

    .venv/bin/python benchmarks/observe_cost.py [N]
    .venv/bin/python -m cProfile -s tottime benchmarks/observe_cost.py | head -40
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

from scry.config import ObservabilityConfig
from scry.observe.events import encode_batch
from scry.observe.pipeline import Observatory
from scry.observe.record import ClientContext

TEXT = b"SELECT abalance FROM pgbench_accounts WHERE aid = %d;"


def make_records(n: int) -> list[tuple]:
    ctx = ClientContext("c1", "bench", "bench", "pgbench")
    rng = random.Random(1)
    now = time.perf_counter_ns()
    out = []
    for i in range(n):
        t0 = now + i * 60_000
        text = TEXT % rng.randrange(1, 10_000_000)
        out.append((ctx, text, t0, t0 + 1_000, t0 + 1_000, t0 + 55_000, 1, None, None))
    return out


def best_of(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        best = min(best, fn())
    return best


def bench(n: int) -> None:
    records = make_records(n)
    texts = [r[1] for r in records]

    obs = Observatory(ObservabilityConfig())
    fp = obs.fingerprinter
    fp.lookup(texts[0])  # the one pglast parse for this shape

    def fingerprint_only() -> float:
        t = time.process_time()
        for text in texts:
            fp.lookup(text)
        return (time.process_time() - t) / n * 1e6

    def record_only() -> float:
        obs._records.clear()
        t = time.process_time()
        rec = obs.record
        for r in records:
            rec(r)
        return (time.process_time() - t) / n * 1e6

    def drain(o: Observatory) -> float:
        o._records.extend(records)
        t = time.process_time()
        o.drain()
        return (time.process_time() - t) / n * 1e6

    print(f"records: {n} distinct-literal pgbench -S texts, one shape")
    print(f"  record() (hot path append)     {best_of(record_only):6.2f} µs")
    obs._records.clear()
    print(f"  fingerprint (cached shape)     {best_of(fingerprint_only):6.2f} µs")
    print(f"  drain, sink none               {best_of(lambda: drain(obs)):6.2f} µs")

    events_obs = Observatory(ObservabilityConfig(), sink=_CountingSink())
    drain(events_obs)

    def drain_with_events() -> float:
        events_obs.ring.take(len(events_obs.ring))
        return drain(events_obs)

    print(f"  drain + event into ring        {best_of(drain_with_events):6.2f} µs")
    batch = events_obs.ring.take(100) or [()]
    for compression in ("gzip", "none"):
        t = time.process_time()
        for _ in range(50):
            encode_batch(batch, compression)
        per_event = (time.process_time() - t) / 50 / len(batch) * 1e6
        print(f"  encode batch of 100, {compression:4s}      {per_event:6.2f} µs per event")
    off = Observatory(ObservabilityConfig(fingerprinting=False))
    print(f"  record(), fingerprinting off   {best_of(lambda: _time_calls(off, records)):6.2f} µs")


def _time_calls(obs: Observatory, records: list[tuple]) -> float:
    t = time.process_time()
    rec = obs.record
    for r in records:
        rec(r)
    return (time.process_time() - t) / len(records) * 1e6


class _CountingSink:
    async def write(self, payload: bytes, flags: int, count: int) -> bool:
        return True

    async def close(self) -> None:
        return None


if __name__ == "__main__":
    bench(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000)
    asyncio.run(asyncio.sleep(0))
