"""scry.pgbouncer.merge: one console answer out of every worker's (wire bytes in and out)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.pgbouncer.merge import instance_id, local_id, merge_show, parse_answer
from scry.pgbouncer.results import INT4, NUMERIC, TEXT, error, result

T, INT, N = TEXT, INT4, NUMERIC


def rows_of(answer: bytes) -> list[list[Any]]:
    return parse_answer(answer).rows


def merged(view: str, columns: list[tuple[str, int]], *per_worker: list[list[Any]]) -> list:
    answers = {w: result(columns, rows, "SHOW") for w, rows in enumerate(per_worker)}
    return rows_of(merge_show(view, answers, own=0, workers=len(per_worker)))


def test_pools_add_up_and_keep_the_longest_wait() -> None:
    columns = [("database", T), ("user", T), ("cl_active", INT), ("sv_idle", INT),
               ("maxwait", INT), ("maxwait_us", INT), ("pool_mode", T)]  # fmt: skip
    rows = merged(
        "pools",
        columns,
        [["app", "app", 3, 1, 0, 900_000, "transaction"], ["pgbouncer", "pgbouncer", 1, 0, 0, 0, "statement"]],
        [["app", "app", 4, 2, 1, 5, "transaction"], ["other", "app", 1, 0, 0, 0, "session"]],
    )  # fmt: skip
    assert rows == [
        ["app", "app", "7", "3", "1", "5", "transaction"],  # 1 s 5 µs beats 0.9 s
        ["pgbouncer", "pgbouncer", "1", "0", "0", "0", "statement"],
        ["other", "app", "1", "0", "0", "0", "session"],  # only on worker 1
    ]


def test_databases_add_budget_shares_but_not_settings_or_the_console_row() -> None:
    columns = [("name", T), ("port", INT), ("pool_size", INT), ("current_connections", INT),
               ("paused", INT), ("server_lifetime", INT)]  # fmt: skip
    rows = merged(
        "databases",
        columns,
        [["app", 5432, 3, 2, 0, 3600], ["pgbouncer", 6432, 2, 0, 0, 3600]],
        [["app", 5432, 2, 1, 1, 3600], ["pgbouncer", 6432, 2, 0, 0, 3600]],
    )
    assert rows == [
        ["app", "5432", "5", "3", "1", "3600"],
        ["pgbouncer", "6432", "2", "0", "0", "3600"],
    ]


def test_stats_weigh_times_by_rates() -> None:
    columns = [("database", T), ("total_query_count", N), ("avg_query_count", N),
               ("avg_query_time", N), ("avg_wait_time", N)]  # fmt: skip
    rows = merged("stats", columns, [["app", 100, 30, 10, 0]], [["app", 50, 10, 50, 8]])
    # 30 queries/s at 10 µs and 10/s at 50 µs: 20 µs a query, not 60 or 30.
    assert rows == [["app", "150", "40", "20", "2"]]


def test_totals_weigh_times_by_the_rate_rows() -> None:
    names = ["total_query_count", "avg_query_count", "avg_query_time", "avg_xact_count",
             "avg_xact_time", "avg_wait_time"]  # fmt: skip
    columns = [("name", T), ("value", N)]
    a = dict(zip(names, [10, 3, 100, 0, 0, 4], strict=True))
    b = dict(zip(names, [20, 1, 200, 0, 0, 0], strict=True))
    rows = merged("totals", columns, list(map(list, a.items())), list(map(list, b.items())))
    assert dict(rows) == {
        "total_query_count": "30", "avg_query_count": "4", "avg_query_time": "125",
        "avg_xact_count": "0", "avg_xact_time": "0", "avg_wait_time": "3",
    }  # fmt: skip


def test_lists_add_what_each_worker_holds_and_not_the_configured_names() -> None:
    columns = [("list", T), ("items", INT)]
    rows = merged(
        "lists",
        columns,
        [["databases", 3], ["pools", 2], ["used_clients", 5], ["used_servers", 1]],
        [["databases", 3], ["pools", 1], ["used_clients", 7], ["used_servers", 2]],
    )
    assert rows == [
        ["databases", "3"],
        ["pools", "2"],
        ["used_clients", "12"],
        ["used_servers", "3"],
    ]


def test_connections_get_instance_wide_ids() -> None:
    columns = [("type", T), ("ptr", T), ("link", T), ("id", INT)]
    rows = merged(
        "clients",
        columns,
        [["C", "c1", "s1", 1], ["C", "c2", "", 2]],
        [["C", "c1", "", 1], ["C", "a1000001", "", 1000001]],
    )
    assert rows == [
        ["C", "w0.c1", "w0.s1", "2"],
        ["C", "w1.c1", "", "3"],
        ["C", "w0.c2", "", "4"],
        ["C", "w1.a1000001", "", "2000003"],
    ]
    for number, worker, own in ((2, 0, 1), (3, 1, 1), (2000003, 1, 1000001)):
        assert local_id(number, 2) == (worker, own)
        assert instance_id(own, worker, 2) == number


def test_breaker_shows_the_most_severe_state() -> None:
    columns = [("database", T), ("state", T), ("failures", INT), ("reason", T)]
    rows = merged(
        "breaker", columns, [["app", "closed", 0, None]], [["app", "open", 5, "too many errors"]]
    )
    assert rows == [["app", "open", "5", "too many errors"]]


def test_views_that_are_the_same_everywhere_and_errors_are_the_own_workers() -> None:
    mine = result([("version", T)], [["PgBouncer 1.25.0 (scry)"]], "SHOW")
    theirs = result([("version", T)], [["something else"]], "SHOW")
    assert merge_show("version", {0: theirs, 1: mine}, own=1, workers=2) == mine
    refused = error("admin access needed")
    pools = result([("database", T), ("cl_active", INT)], [["app", 1]], "SHOW")
    assert merge_show("pools", {0: refused, 1: pools}, own=0, workers=2) == refused


@pytest.mark.parametrize("other", ["columns", "error"])
def test_a_worker_answering_otherwise_is_left_out(other: str) -> None:
    columns = [("database", T), ("user", T), ("cl_active", INT)]
    mine = result(columns, [["app", "app", 2]], "SHOW")
    if other == "columns":  # (a rolling upgrade)
        theirs = result([*columns, ("new", INT)], [["app", "app", 5, 1]], "SHOW")
    else:
        theirs = error("boom")
    answer = merge_show("pools", {0: mine, 1: theirs}, own=0, workers=2)
    assert rows_of(answer) == [["app", "app", "2"]]


_POOL_COLUMNS = [("database", T), ("user", T), ("cl_active", INT), ("maxwait", INT),
                 ("maxwait_us", INT), ("pool_mode", T)]  # fmt: skip
_pool_rows = st.lists(
    st.tuples(
        st.sampled_from(["app", "b", "pgbouncer"]), st.sampled_from(["app", "u"]),
        st.integers(0, 500), st.integers(0, 100), st.integers(0, 999_999),
    ),
    max_size=6,
    unique_by=lambda row: row[:2],
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(_pool_rows, min_size=1, max_size=4))
def test_pools_merge_to_the_sums_and_the_longest_wait(per_worker: list[list[tuple]]) -> None:
    rows = [[[*row, "transaction"] for row in worker] for worker in per_worker]
    out = merged("pools", _POOL_COLUMNS, *rows)
    if len(rows) == 1:
        assert out == [[str(v) for v in row] for row in rows[0]]  # one worker: its answer
    by_key = {(r[0], r[1]): r for r in out}
    assert len(by_key) == len(out)  # one row per pool
    actives: dict[tuple[str, str], list[int]] = {}
    waits: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for worker in per_worker:
        for db, user, active, wait_s, wait_us in worker:
            actives.setdefault((db, user), []).append(active)
            waits.setdefault((db, user), []).append((wait_s, wait_us))
    assert set(by_key) == set(actives)
    for key, row in by_key.items():
        assert int(row[2]) == sum(actives[key])
        assert (int(row[3]), int(row[4])) == max(waits[key])
