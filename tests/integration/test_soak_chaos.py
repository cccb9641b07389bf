"""A soak under faults: many clients, backends terminated and queries
cancelled at random, in transaction pooling.

What must hold however the faults fall: every answer a client gets is the
answer to its own query; a client sees only the errors PostgreSQL itself
would give it (its session terminated, or its own cancel), never two errors
for one query; a client that never cancels is never cancelled; and once the
faults stop, the pool serves everyone with no more servers than its size and
nothing left running. The proxy's log has no traceback (the fixture checks).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import psycopg
import psycopg.errors
import pytest
from psycopg.pq import TransactionStatus

CLIENTS = 16
PHASE_SECONDS = 5.0
POOL_SIZE = 6


def _connect(proxy) -> psycopg.Connection:
    return psycopg.connect(**proxy.conninfo(), autocommit=True)


def _one_step(conn: psycopg.Connection, rnd: random.Random) -> bool:
    """A query or a short transaction; whether the answer was the right one."""
    value = rnd.randrange(1 << 30)
    if rnd.random() < 0.5:
        row = conn.execute("select %s::int from pg_sleep(0.002)", (value,)).fetchone()
    else:
        with conn.transaction():
            conn.execute("select pg_sleep(0.002)")
            row = conn.execute("select %s::int", (value,)).fetchone()
    return row == (value,)


def _client(proxy, seed: int, cancels: bool, stop: threading.Event, seen: Counter) -> None:
    try:
        _steps(proxy, seed, cancels, stop, seen)
    except Exception as exc:  # (a thread's exception would only be a warning)
        seen[f"unexpected: {exc!r}"] += 1


def _steps(proxy, seed: int, cancels: bool, stop: threading.Event, seen: Counter) -> None:
    rnd = random.Random(seed)
    conn = _connect(proxy)
    while not stop.is_set():
        canceller = None
        if cancels and rnd.random() < 0.5:
            canceller = threading.Timer(rnd.uniform(0, 0.01), conn.cancel_safe)
            canceller.start()
        try:
            seen["ok" if _one_step(conn, rnd) else "wrong answer"] += 1
        except psycopg.Error as exc:
            seen[f"{'canceller' if cancels else 'bystander'}: {type(exc).__name__}"] += 1
            if exc.sqlstate not in ("57014", "57P01", None):
                seen[f"unexpected: {exc}"] += 1
        finally:
            if canceller is not None:
                canceller.join()
        if not conn.broken and conn.info.transaction_status == TransactionStatus.INERROR:
            # A cancel that lands on the COMMIT fails it and leaves the
            # transaction aborted (so it does against PostgreSQL itself), and
            # psycopg's transaction() does not roll back after a failed
            # COMMIT: the application must (once its cancel has been acted on).
            conn.execute("rollback")
        if conn.broken:
            conn = _connect(proxy)
    conn.close()


def _terminator(pg, stop: threading.Event, done: Counter) -> None:
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as admin:
        while not stop.wait(0.05):
            admin.execute(
                "select pg_terminate_backend(pid) from pg_stat_activity"
                " where usename = 'app' and datname = 'app' and backend_type = 'client backend'"
                " order by random() limit 1"
            )
            done["terminated"] += 1


def _phase(proxy, pg, *, terminate: bool, cancels: bool) -> Counter:
    seen: Counter = Counter()
    stop = threading.Event()
    threads = [
        threading.Thread(target=_client, args=(proxy, seed, cancels and seed % 2 == 0, stop, seen))
        for seed in range(CLIENTS)
    ]
    if terminate:
        threads.append(threading.Thread(target=_terminator, args=(pg, stop, seen)))
    for thread in threads:
        thread.start()
    time.sleep(PHASE_SECONDS)  # (the soak's length, not a wait for an event)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), f"a client hung: {seen}"
    return seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_soak_with_terminated_backends_and_cancels(scry_proxy, pg, backend_count, wait_until):
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": POOL_SIZE}})

    killed = _phase(proxy, pg, terminate=True, cancels=False)
    assert killed["terminated"] > 20 and killed["ok"] > 500, killed
    assert killed["wrong answer"] == 0, killed
    # PostgreSQL's own FATAL, or the close that follows it; never two errors
    # for one query ("received 2 results": InternalError) nor anything else.
    assert not [k for k in killed if k.startswith("unexpected") or "InternalError" in k], killed

    cancelled = _phase(proxy, pg, terminate=False, cancels=True)
    assert cancelled["canceller: QueryCanceled"] > 10 and cancelled["ok"] > 500, cancelled
    assert cancelled["wrong answer"] == 0, cancelled
    assert not [k for k in cancelled if k.startswith(("bystander", "unexpected"))], cancelled

    wait_until(
        lambda: backend_count(pg, proxy=proxy) <= POOL_SIZE,
        10,
        what=f"at most {POOL_SIZE} servers once the faults stop",
    )
    with _connect(proxy) as conn:
        assert conn.execute("select 'healed'").fetchone() == ("healed",)
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as admin:
        (running,) = admin.execute(
            "select count(*) from pg_stat_activity where usename = 'app'"
            " and state <> 'idle' and backend_start >= to_timestamp(%s)",
            (proxy.started_wall,),
        ).fetchone()
    assert running == 0
