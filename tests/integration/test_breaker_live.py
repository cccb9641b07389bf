"""The circuit breaker against a PostgreSQL that really goes away and comes back.

The session ``pg`` cluster is shared by every test, so the outage is staged on
a second, module-scoped :class:`DevCluster` that this module stops and starts.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import psycopg
import psycopg.errors
import pytest

from scry.devcluster import DevCluster

BREAKER = {"failure_threshold": 3, "success_threshold": 2, "timeout_seconds": 2}
FAST = 0.2  # a refusal must come back within this (no connect timeout, no queueing)


@pytest.fixture(scope="module")
def outage_pg():
    """A second cluster this module may stop and start (its directory survives stop())."""
    base = Path(tempfile.mkdtemp(prefix="scry-pg-outage-"))
    base.chmod(0o755)
    cluster = DevCluster(base_dir=base, ssl=False)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def connect(proxy, **kwargs) -> psycopg.Connection:
    return psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=None, **kwargs)


def attempt(proxy, conn: psycopg.Connection | None = None) -> tuple[str | None, float, bool]:
    """Run ``select 1`` (on ``conn`` or a new connection): (SQLSTATE or None, seconds
    the query took, whether the connection survived)."""
    own = conn is None
    if own:
        conn = connect(proxy)  # scry knows the server's parameters: no server needed
    assert conn is not None
    started = time.monotonic()
    try:
        conn.execute("select 1")
        state = None
    except psycopg.Error as exc:
        state = exc.sqlstate
    elapsed = time.monotonic() - started
    alive = not conn.closed and conn.info.status == psycopg.pq.ConnStatus.OK
    if own:
        conn.close()
    return state, elapsed, alive


def test_breaker_opens_fails_fast_and_recovers_when_the_server_is_back(
    scry_proxy, outage_pg
) -> None:
    # A timeout far longer than the test: the breaker opened on a server that
    # was gone, so the login it tries every second must end OPEN, not the timeout.
    proxy = scry_proxy(
        {
            "database_url": outage_pg.url(),
            "pool": {"mode": "transaction", "size": 2},
            "circuit_breaker": {**BREAKER, "timeout_seconds": 120},
            "timeouts": {"server_connect_timeout": 2, "query_wait_timeout": 5},
        }
    )
    with connect(proxy) as conn:
        assert conn.execute("select 1").fetchone() == (1,)

    outage_pg.stop()
    try:
        # Until the breaker opens, each attempt fails on a refused connection.
        before: list[str | None] = []
        for _ in range(10):
            state, _, _ = attempt(proxy)
            if state == "57P03":
                break
            before.append(state)
        else:
            pytest.fail(f"the breaker never opened; attempts failed with {before}")
        assert before and all(s is not None and s.startswith("08") for s in before), before
        assert len(before) <= BREAKER["failure_threshold"], before

        # Open: every new transaction is refused at once, with a retryable ERROR
        # that leaves the client's connection usable.
        held = connect(proxy)
        for _ in range(10):
            for conn in (None, held):
                state, elapsed, alive = attempt(proxy, conn)
                assert state == "57P03", state
                assert elapsed < FAST, f"refusal took {elapsed:.3f}s"
                assert alive
        with pytest.raises(psycopg.errors.CannotConnectNow) as info:
            held.execute("select 1")
        assert str(info.value).startswith("circuit breaker open for database app")
        assert str(info.value).endswith("retry in 1 s"), str(info.value)
    finally:
        outage_pg.start()
    back_at = time.monotonic()

    # Half-open once a login succeeds, closed after success_threshold probes.
    states: list[str | None] = []
    deadline = back_at + 15
    while True:
        state, elapsed, alive = attempt(proxy, held)
        assert alive
        states.append(state)
        if state is None:
            break
        assert state == "57P03", states
        assert time.monotonic() < deadline, f"never recovered: {Counter(states)}"
        time.sleep(0.05)
    # One login a second, then success_threshold probes: well inside 5 s.
    assert time.monotonic() - back_at < 5, Counter(states)
    for _ in range(20):
        assert attempt(proxy, held)[0] is None
        assert attempt(proxy)[0] is None
    held.close()
    log = proxy.log_text()
    for transition in (
        "circuit breaker open",
        "circuit breaker half_open",
        "a server login succeeded",
        "circuit breaker closed",
    ):
        assert transition in log, proxy.log_tail()


def test_syntax_errors_do_not_open_the_breaker(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"size": 2}, "circuit_breaker": BREAKER})
    with connect(proxy) as conn:
        for _ in range(100):
            with pytest.raises(psycopg.errors.SyntaxError):
                conn.execute("SELEC 1")
        for _ in range(20):
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("select 1/0")
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("select * from no_such_table")
        assert conn.execute("select 42").fetchone() == (42,)
    with connect(proxy) as other:
        assert other.execute("select 43").fetchone() == (43,)
    assert "circuit breaker open" not in proxy.log_text()


def test_the_breakers_reason_names_the_condition_not_the_message(scry_proxy) -> None:
    """PostgreSQL's message can quote what a client sent; the reason goes to
    the log and to every client refused: it says the SQLSTATE's name only."""
    proxy = scry_proxy({"pool": {"size": 2}, "circuit_breaker": BREAKER})
    sick = "DO $$ BEGIN RAISE EXCEPTION 'canary-b7e2' USING ERRCODE = 'XX000'; END $$"
    with connect(proxy) as conn:
        for _ in range(BREAKER["failure_threshold"]):
            with pytest.raises(psycopg.errors.InternalError_):
                conn.execute(sick)
    with connect(proxy) as conn, pytest.raises(psycopg.errors.CannotConnectNow) as refused:
        conn.execute("select 1")
    assert "XX000 internal_error" in str(refused.value) and "canary" not in str(refused.value)
    log = proxy.log_text()
    assert "XX000 internal_error" in log and "canary" not in log


async def test_predictive_breaker_opens_on_latency(scry_proxy) -> None:
    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 8},
            "circuit_breaker": {**BREAKER, "timeout_seconds": 30},
            "health": {
                "predictive": True,
                "window_seconds": 2,
                "sustain_seconds": 0,
                "min_samples": 5,
                "latency_floor_ms": 50,
                "latency_spike_factor": 3,
                "baseline_half_life_seconds": 60,
            },
        }
    )
    conns = [
        await psycopg.AsyncConnection.connect(
            **proxy.conninfo(), autocommit=True, prepare_threshold=None
        )
        for _ in range(6)
    ]
    outcomes: Counter[str] = Counter()
    other_errors: list[str] = []
    slow = asyncio.Event()
    opened = asyncio.Event()
    refusal_times: list[float] = []

    async def client(conn: psycopg.AsyncConnection) -> None:
        while not opened.is_set():
            sql = "select pg_sleep(0.15)" if slow.is_set() else "select 1"
            started = time.monotonic()
            try:
                await conn.execute(sql)
                outcomes["slow ok" if slow.is_set() else "fast ok"] += 1
            except psycopg.errors.CannotConnectNow as exc:
                refusal_times.append(time.monotonic() - started)
                assert "predictive" in str(exc), str(exc)
                outcomes["57P03"] += 1
                opened.set()
            except psycopg.Error as exc:  # a hard failure: the test's point is there is none
                other_errors.append(f"{exc.sqlstate}: {exc}")
                opened.set()
            if not slow.is_set():
                await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(client(conn)) for conn in conns]
    try:
        # Healthy traffic long enough for the baseline (window_seconds updates
        # of min_samples queries each; the monitor evaluates once a second).
        await asyncio.sleep(3.5)
        assert not opened.is_set(), f"opened on healthy traffic: {outcomes} {other_errors}"
        slow.set()  # latency injected: every query now sleeps 150 ms
        await asyncio.wait_for(opened.wait(), 10)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for conn in conns:
            await conn.close()
    assert not other_errors, other_errors
    assert outcomes["57P03"] >= 1 and outcomes["slow ok"] >= 1, outcomes
    assert max(refusal_times) < FAST, refusal_times
    # Open means open for everybody, fast, without touching PostgreSQL.
    for _ in range(5):
        state, elapsed, alive = attempt(proxy)
        assert (state, alive) == ("57P03", True) and elapsed < FAST, (state, elapsed)
    log = proxy.log_text()
    assert "predictive" in log and "predictive: predictive" not in log
    assert "health anomaly " in log and "kind=latency_spike" in log
