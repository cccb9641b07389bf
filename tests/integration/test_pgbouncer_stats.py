"""SHOW STATS against PgBouncer: the same client script, the same counters.

PgBouncer and scry-pgbouncer run from the same ini; one client script runs
against each (simple queries, an explicit transaction, autocommit statements,
errors, psycopg prepared statements, a pipeline). The deterministic counters
must be equal: transactions, queries, bytes received and sent. PgBouncer
counts a query from a client's request to the ReadyForQuery that answers all
it sent (a pipeline counts once), excludes the Terminate message from the
bytes received and counts every byte its servers sent.

The installed PgBouncer (Debian's 1.18) has no parse/bind or assignment
columns: those are checked against PgBouncer 1.21+'s documented meaning
(named prepared statements only, in transaction pooling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from test_pgbouncer_compat import Bouncer, bouncer_dir, running

from scry.devcluster import DevCluster

DETERMINISTIC = ("total_xact_count", "total_query_count", "total_received", "total_sent")


@pytest.fixture
def pair(pg: DevCluster) -> Iterator[tuple[Bouncer, Bouncer]]:
    with (
        bouncer_dir() as directory,
        running("pgbouncer", pg, directory) as real,
        running("scry", pg, directory) as ours,
    ):
        yield real, ours


def stats(b: Bouncer, database: str = "app") -> dict[str, Any]:
    """SHOW STATS of ``database`` (all 0 while PgBouncer does not list it yet)."""
    columns, rows, _ = b.admin("SHOW STATS")
    names = [c for c, _ in columns]
    row = next((r for r in rows if r[0] == database), None)
    if row is None:
        return dict.fromkeys(names[1:], 0)
    return dict(zip(names, row, strict=True))


def run_script(conn: psycopg.Connection[Any]) -> None:
    """Every kind of request once or more; deterministic on the wire."""
    for n in range(3):
        conn.execute(f"select {n}")  # simple Query, autocommit
    with conn.transaction():  # BEGIN, 2 statements, COMMIT: one transaction
        conn.execute("select 'a'")
        conn.execute("select 'b'")
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("select 1/0")
    with pytest.raises(psycopg.errors.UndefinedTable), conn.transaction():
        conn.execute("select 1 from no_such_table")  # aborts the transaction
    conn.prepare_threshold = 5
    for n in range(4):  # one named Parse (its own round trip), four Binds of it
        assert conn.execute("select %s::int * 2", (n,), prepare=True).fetchone() == (n * 2,)
    conn.execute("select %s::text", ("unnamed",), prepare=False)  # unnamed statement
    with conn.transaction():
        conn.execute("select %s::int * 2", (7,), prepare=True)
        conn.execute("select %s::int * 2", (8,), prepare=True)


def run_pipeline(conn: psycopg.Connection[Any]) -> None:
    with conn.pipeline():
        for n in range(3):
            conn.execute("select %s::int", (n,))


def test_counters_match_pgbouncer(pair: tuple[Bouncer, Bouncer]) -> None:
    seen: dict[str, list[dict[str, Any]]] = {}
    for b in pair:
        before = stats(b)
        with b.connect() as conn:
            run_script(conn)
            after_script = stats(b)
            run_pipeline(conn)
        seen[b.kind] = [before, after_script, stats(b)]
    theirs, ours = seen["pgbouncer"], seen["scry"]
    for key in DETERMINISTIC:
        assert ours[0][key] == theirs[0][key] == 0, key
        assert ours[1][key] == theirs[1][key], (key, ours[1][key], theirs[1][key])
    # The pipeline (three Parse/Bind/Describe/Execute, flushed one by one, then
    # a Sync and a Flush) counts once. PgBouncer 1.18 once counted two
    # transactions for it in CI (not reproduced in 14 runs since, 8 of them
    # on a loaded machine): only scry's figure is held exact here.
    # psycopg may add a Flush (5 bytes) to a pipeline depending on timing, so
    # its bytes may differ by that much.
    for key in ("total_xact_count", "total_query_count"):
        assert ours[2][key] - ours[1][key] == 1, key
        assert 1 <= theirs[2][key] - theirs[1][key] <= 2, key
    for key in ("total_received", "total_sent"):
        assert abs(ours[2][key] - theirs[2][key]) <= 5, (key, ours[2][key], theirs[2][key])
    # The script's own figures, so that a change on both sides is noticed too.
    assert ours[1]["total_xact_count"] == 13
    assert ours[1]["total_query_count"] == 21
    final = ours[2]
    assert final["total_query_time"] > 0
    assert final["total_xact_time"] >= final["total_query_time"]
    # Named statements only, as PgBouncer 1.21+ counts them.
    assert final["total_client_parse_count"] == 1
    assert final["total_server_parse_count"] == 1
    assert final["total_bind_count"] == 6
    # scry keeps the server with its client between transactions while nobody
    # else needs it: one assignment here, where PgBouncer makes one per transaction.
    assert 1 <= final["total_server_assignment_count"] <= final["total_xact_count"]


def test_wait_time_and_maxwait_match(pg: DevCluster) -> None:
    """One server, two clients: the second waits; both poolers report the wait."""
    waited: dict[str, tuple[Decimal, int]] = {}
    with bouncer_dir() as directory:
        for kind in ("pgbouncer", "scry"):
            with running(kind, pg, directory, extra="default_pool_size = 1\n") as b:
                waited[kind] = _wait_for_the_only_server(b)
    for kind, (total_wait, maxwait_us) in waited.items():
        assert maxwait_us >= 200_000, kind
        assert total_wait >= 200_000, kind


def _wait_for_the_only_server(b: Bouncer) -> tuple[Decimal, int]:
    """(SHOW STATS total_wait_time afterwards, the maxwait SHOW POOLS showed meanwhile)."""
    holder = b.connect()
    holder.execute("begin")
    holder.execute("select 1")  # the pool's only server is now in this transaction
    result: list[Any] = []
    waiter = threading.Thread(
        target=lambda: result.append(b.connect().execute("select 2").fetchone())
    )
    waiter.start()
    deadline = time.monotonic() + 10
    maxwait_us = 0
    while maxwait_us < 200_000:
        assert time.monotonic() < deadline, "the second client never waited 0.2 s"
        columns, rows, _ = b.admin("SHOW POOLS")
        names = [c for c, _ in columns]
        app = next(r for r in rows if r[0] == "app")
        maxwait_us = app[names.index("maxwait")] * 1_000_000 + app[names.index("maxwait_us")]
        time.sleep(0.02)
    assert app[names.index("cl_waiting")] == 1
    holder.execute("commit")
    waiter.join(10)
    holder.close()
    assert result == [(2,)]
    return stats(b)["total_wait_time"], maxwait_us


def test_parse_counts_follow_the_server(pg: DevCluster) -> None:
    """A statement prepared again on a new server counts as a server Parse."""
    with bouncer_dir() as directory, running("scry", pg, directory) as b:
        with b.connect() as conn:
            conn.prepare_threshold = 5
            conn.execute("select %s::int", (1,), prepare=True)
            assert b.admin("RECONNECT app")[2] == "RECONNECT"
            assert b.admin("WAIT_CLOSE app")[2] == "WAIT_CLOSE"
            conn.execute("select %s::int", (2,), prepare=True)
            conn.execute("select %s::int", (3,), prepare=True)
        final = stats(b)
    assert final["total_client_parse_count"] == 1
    assert final["total_server_parse_count"] == 2  # prepared on the new server too
    assert final["total_bind_count"] == 3
    assert final["total_server_assignment_count"] >= 2
