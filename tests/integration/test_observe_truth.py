"""Observability truth: scry's per-fingerprint counts against pg_stat_statements,
and no client literal in anything scry writes when anonymizing.

scry's statistics are read from its admin API (``GET /api/v1/queries/top``:
calls and errors per fingerprint); the event file sink (one event per
statement: fingerprint, normalized text, SQLSTATE) is read back too and must
agree with it.

Mapping scry's fingerprints to pg_stat_statements entries: every raw text the
workload runs gets its queryid from PostgreSQL itself (``EXPLAIN (VERBOSE)``
prints the Query Identifier without running the statement); texts with
``$n`` parameters (prepared by psycopg) are matched to the pg_stat_statements
entry with exactly that text. pg_stat_statements counts only statements that
completed, so scry's successful statements are what is compared.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psycopg
import psycopg.errors
import pytest

from scry.devcluster import free_port
from scry.observe.events import read_events
from scry.observe.fingerprint import Fingerprinter

EVENTS = {"sink": "file", "flush_interval_ms": 100, "compression": "gzip"}


def events_config(path: Path, **observability) -> dict:
    return {"observability": {"events": {**EVENTS, "path": str(path)}, **observability}}


def admin_config() -> tuple[dict, str]:
    """An admin API on a free loopback port (no token: GETs are open on loopback)."""
    port = free_port()
    return {
        "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{port}"}
    }, f"http://127.0.0.1:{port}"


def admin_get(base: str, path: str, **params) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        try:
            response = httpx.get(base + path, params=params, timeout=5)
            assert response.status_code == 200, response.text
            return response
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def top_calls(base: str) -> dict[str, dict]:
    """scry's statistics per fingerprint since start, from the admin API."""
    rows = admin_get(base, "/api/v1/queries/top", by="calls", limit=1000).json()["queries"]
    return {row["fingerprint"]: row for row in rows}


def read_all_events(path: Path) -> list[dict]:
    """Every event in the sink's file (and its rotations, if any)."""
    events: list[dict] = []
    for file in sorted(path.parent.glob(path.name + "*")):
        events.extend(read_events(file))
    return events


def wait_for_events(path: Path, predicate, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        events = read_all_events(path) if path.exists() else []
        if predicate(events):
            return events
        if time.monotonic() > deadline:
            pytest.fail(f"events never satisfied the condition; got {len(events)}")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------

LITERAL_TEXTS = [
    # literal variants of one query
    *(f"select name from obs_t where id = {n}" for n in (1, 2, 3, 4, 5)),
    "select name from obs_t where id = -3",
    "SELECT name FROM obs_t WHERE id = 7",
    "select name  from obs_t\n  where id=8",
    "/* a comment */ select name from obs_t where id = 9",
    # string literals
    "select id from obs_t where name = 'n1'",
    "select id from obs_t where name = 'n2'",
    "select id from obs_t where name = 'it''s'",
    # IN lists of various lengths
    "select count(*) from obs_t where id in (1)",
    "select count(*) from obs_t where id in (1, 2)",
    "select count(*) from obs_t where id in (3, 4, 5, 6)",
    "select count(*) from obs_t where id in (7, 8)",
    "select count(*) from obs_t where id in (9)",
    # writes
    "insert into obs_t (id, name) values (1001, 'x1')",
    "insert into obs_t (id, name) values (1002, 'x2')",
    "update obs_t set name = 'u' where id = 1001",
    "update obs_t set name = 'v' where id = 1002",
    # constants
    "select 1",
    "select 2",
    "select 'x'",
]

ERROR_TEXTS = [
    ("select 1 / 0", psycopg.errors.DivisionByZero),
    ("select 1 / 0", psycopg.errors.DivisionByZero),
    ("select name from obs_missing where id = 1", psycopg.errors.UndefinedTable),
    ("selec 1", psycopg.errors.SyntaxError),
    ("select name from obs_t where id = 'notanumber'", psycopg.errors.InvalidTextRepresentation),
]

PREPARED_RUNS = [
    ("select name from obs_t where id = %s", [(n,) for n in range(1, 7)]),
    ("select count(*) from obs_t where id = any(%s)", [([1],), ([1, 2, 3],), ([4, 5],)]),
    ("select %s::int + %s::int", [(1, 2), (3, 4)]),
]
PREPARED_ERROR = ("select 10 / %s::int", (0,))
MARKER = "select 'obs workload done', 'marker'"
MARKER_NORMALIZED = "select $1, $2"
PREPARED_MANY = (
    "insert into obs_t (id, name) values (%s, %s)",
    [(2000 + i, f"m{i}") for i in range(5)],
)


def to_pg(sql: str) -> str:
    """psycopg's server-side text of a query with %s placeholders."""
    n = 0

    def number(_match: re.Match) -> str:
        nonlocal n
        n += 1
        return f"${n}"

    return re.sub(r"%s", number, sql)


def query_id(admin: psycopg.Connection, text: str) -> int | None:
    """PostgreSQL's queryid of ``text``; None when it does not plan (errors)."""
    try:
        with admin.transaction():
            rows = admin.execute(f"explain (verbose, costs off) {text}").fetchall()
    except psycopg.Error:
        return None
    for (line,) in rows:
        m = re.search(r"Query Identifier: (-?\d+)", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no Query Identifier for {text!r}: {rows}")


class Observed:
    """The workload's statements, scry's events, pg_stat_statements, and the maps."""

    sent: list[str]  # every statement as PostgreSQL received its text
    events: list[dict]  # scry's events of the workload's clients
    top: dict[str, dict]  # the admin API's statistics per fingerprint
    fp_of: dict[str, str]  # raw text -> scry fingerprint
    qids_of: dict[str, set[int]]  # raw text -> its queryids (none: it does not plan)
    pgss: dict[int, tuple[int, str]]  # queryid -> (calls, query) for user app


@pytest.fixture(scope="module")
def observed(scry_proxy_module, pg, tmp_path_factory) -> Observed:
    if not pg.pg_stat_statements:
        pytest.skip("pg_stat_statements is not available")
    events_path = tmp_path_factory.mktemp("obs") / "events.bin"
    admin_cfg, base = admin_config()
    proxy = scry_proxy_module(
        {"pool": {"mode": "transaction", "size": 2}, **admin_cfg, **events_config(events_path)}
    )
    admin_get(base, "/healthz")
    obs = Observed()
    with psycopg.connect(pg.dsn(user="postgres"), autocommit=True) as admin:
        admin.execute("drop table if exists obs_t")
        admin.execute("create table obs_t (id int primary key, name text)")
        admin.execute("insert into obs_t select g, 'n' || g from generate_series(1, 100) g")
        admin.execute("grant all on obs_t to app")
        (app_oid,) = admin.execute("select oid from pg_roles where rolname = 'app'").fetchone()
        admin.execute("select pg_stat_statements_reset()")

        sent: list[str] = []
        with psycopg.connect(
            **proxy.conninfo(), autocommit=True, prepare_threshold=None,
            application_name="obs_literal",
        ) as lit, psycopg.connect(
            **proxy.conninfo(), autocommit=True, prepare_threshold=0,
            application_name="obs_prepared",
        ) as prep:  # fmt: skip
            for rep in range(2):
                for text in LITERAL_TEXTS:
                    if text.startswith("insert"):
                        text = text.replace("(100", f"(1{rep}0")  # other rows, same shape
                    lit.execute(text)
                    sent.append(text)
            for text, exc in ERROR_TEXTS:
                with pytest.raises(exc):
                    lit.execute(text)
                sent.append(text)
            for text, params_list in PREPARED_RUNS:
                for params in params_list:
                    prep.execute(text, params)
                    sent.append(to_pg(text))
            with pytest.raises(psycopg.errors.DivisionByZero):
                prep.execute(*PREPARED_ERROR)
            sent.append(to_pg(PREPARED_ERROR[0]))
            with prep.cursor() as cur:
                cur.executemany(*PREPARED_MANY)  # a pipeline: 5 Executes, one Sync
            sent.extend([to_pg(PREPARED_MANY[0])] * len(PREPARED_MANY[1]))
            # The last statement: once its event is in the file, all are.
            lit.execute(MARKER)
            sent.append(MARKER)

        ours = ("obs_literal", "obs_prepared")
        wait_for_events(events_path, lambda evs: any(e["query"] == MARKER_NORMALIZED and
                        e["application_name"] == "obs_literal" for e in evs[-50:]))  # fmt: skip
        # Events are written in completion order and the workload ran one
        # statement at a time: everything before the marker is in the file.
        events = [e for e in read_all_events(events_path) if e["application_name"] in ours]
        # The statistics are fed by the same drain as the events: complete by now.
        obs.top = top_calls(base)

        pgss = {
            int(qid): (calls, query)
            for qid, calls, query in admin.execute(
                "select queryid, calls, query from pg_stat_statements "
                "where userid = %s and dbid = (select oid from pg_database where datname = 'app')",
                (app_oid,),
            ).fetchall()
        }
        qids_of: dict[str, set[int]] = {}
        literal = {t for t in sent if "$1" not in t}
        for text in literal:
            qid = query_id(admin, text)
            qids_of[text] = {qid} if qid is not None else set()
        literal_qids = set().union(*qids_of.values())
        for text in set(sent) - literal:
            # Same normalized text as literal variants, but other queryids (Param
            # nodes, one entry per parameter type psycopg chose).
            qids_of[text] = {
                qid for qid, (_, query) in pgss.items() if query == text
            } - literal_qids

    fingerprinter = Fingerprinter(None)
    obs.sent = sent
    obs.events = events
    obs.fp_of = {t: fingerprinter.resolve(t.encode())[0].shape.fingerprint for t in sent}
    obs.qids_of = qids_of
    obs.pgss = pgss
    return obs


def covers(obs: Observed) -> dict[str, set[int]]:
    """scry fingerprint -> the queryids of the texts it stands for."""
    result: dict[str, set[int]] = defaultdict(set)
    for text in obs.sent:
        result[obs.fp_of[text]] |= obs.qids_of[text]
    return result


def test_every_statement_counted_once(observed: Observed) -> None:
    """One call per statement the server ran (or refused), under its fingerprint."""
    obs = observed
    want = Counter(obs.fp_of[text] for text in obs.sent)
    for source, seen in (
        ("admin API", Counter({fp: row["calls"] for fp, row in obs.top.items()})),
        ("event file", Counter(e["fingerprint"] for e in obs.events)),
    ):
        details = "\n".join(
            f"{fp}: scry {seen[fp]} calls, workload ran {want[fp]}: "
            + next((e["query"] for e in obs.events if e["fingerprint"] == fp), "?")
            for fp in sorted(set(seen) | set(want))
            if seen[fp] != want[fp]
        )
        assert seen == want, f"scry's statement counts ({source}) differ:\n{details}"


def test_event_file_agrees_with_admin_stats(observed: Observed) -> None:
    obs = observed
    from_events = Counter(e["fingerprint"] for e in obs.events)
    errors = Counter(e["fingerprint"] for e in obs.events if e["sqlstate"] is not None)
    assert {fp: row["calls"] for fp, row in obs.top.items()} == dict(from_events)
    assert {fp: row["errors"] for fp, row in obs.top.items() if row["errors"]} == dict(errors)


def test_success_counts_match_pg_stat_statements(observed: Observed) -> None:
    obs = observed
    covered = covers(obs)
    ok_counts = Counter({fp: row["calls"] - row["errors"] for fp, row in obs.top.items()})
    problems = []
    for fp in sorted(set(obs.fp_of.values()) | set(ok_counts)):
        pg_calls = sum(obs.pgss.get(qid, (0, ""))[0] for qid in covered[fp])
        if ok_counts[fp] != pg_calls:
            texts = sorted({t for t in obs.sent if obs.fp_of[t] == fp})
            problems.append(f"{fp}: scry {ok_counts[fp]} vs pg_stat_statements {pg_calls}: {texts}")
    assert not problems, "\n".join(problems)


def test_no_two_fingerprints_share_a_queryid(observed: Observed) -> None:
    obs = observed
    owners: dict[int, set[str]] = defaultdict(set)
    for fp, qids in covers(obs).items():
        for qid in qids:
            owners[qid].add(fp)
    split = {qid: fps for qid, fps in owners.items() if len(fps) > 1}
    assert not split, "pg_stat_statements entries split across scry fingerprints: " + "; ".join(
        f"{obs.pgss.get(qid, (0, '?'))[1]!r} -> "
        + ", ".join(sorted({t for t in obs.sent if qid in obs.qids_of[t]}))
        for qid in split
    )
    # ... and every queryid the workload produced is covered.
    assert set(owners) == set().union(*obs.qids_of.values())


def test_errors_counted_by_sqlstate(observed: Observed) -> None:
    """pg_stat_statements never sees failed statements; scry counts them."""
    errors = Counter(e["sqlstate"] for e in observed.events if e["sqlstate"] is not None)
    assert errors == Counter({"22012": 3, "42P01": 1, "42601": 1, "22P02": 1}), errors


# --------------------------------------------------------------------------------------
# Canaries: client literals never leave the process when anonymizing
# --------------------------------------------------------------------------------------

CANARY_STR = "zq9canaryXYZ"
CANARY_NUM = "731904517283"
CANARIES = [CANARY_STR, CANARY_NUM, "4817.2093", "c4n4ryd0ll4r", "c4n4ryset", "c4n4ryoff"]


def canary_workload(conn: psycopg.Connection, simple: psycopg.Connection) -> None:
    s, n = CANARY_STR, CANARY_NUM
    statements = [
        f"select '{s}'",
        f"select {n}",
        "select 4817.2093",
        f"select '{s}' || 'suffix', {n} + 1",
        f"select * from (values (1, '{s}')) v(a, b) where b = '{s}' and a <> {n}",
        f"select 1 where 'x' in ('{s}', 'y', '{n}')",
        f"select 1 where 2 in ({n}, 3, 4)",
        f"select $${'c4n4ryd0ll4r'}$$",
        f"select E'{s}\\n'",
        f"select '{s}'::text as label limit {n}",
        f"select count(*) from generate_series(1, 3) g where g::text = '{s}'",
        f"select interval '{n} seconds'",
        "set myapp.other = 'c4n4ryset'",
        "reset myapp.other",
        f"set myapp.canary = '{s}'",
        f"prepare canary_p as select '{s}', {n}",
        "execute canary_p",
        "deallocate canary_p",
    ]
    for sql in statements:
        conn.execute(sql)
    for sql, exc in [
        (f"select '{s}'::int", psycopg.errors.InvalidTextRepresentation),
        (f"select 1 / ({n} - {n})", psycopg.errors.DivisionByZero),
        (f"selec '{s}', {n}", psycopg.errors.SyntaxError),
        (f"select * from no_such_table where x = '{s}'", psycopg.errors.UndefinedTable),
    ]:
        with pytest.raises(exc):
            conn.execute(sql)
    # Simple query protocol, several statements in one message.
    cur = psycopg.ClientCursor(simple)
    cur.execute(f"select '{s}'; select {n}; select 1")
    # Parameters travel separately; bound values must not show up either.
    conn.execute("select %s::text, %s::bigint", (s, int(n)))


def nonstandard_workload(off: psycopg.Connection, switched: psycopg.Connection) -> None:
    """Literals of sessions with standard_conforming_strings off, where
    \\' does not end a literal: read as if it did, the canary is SQL."""
    switched.execute("set standard_conforming_strings = off")
    for conn in (off, switched):
        for text in [
            "select 'x\\' as c4n4ryoff1 --'",
            "select 'it\\'s', 'x\\' as c4n4ryoff2, ' as y",
            "set myapp.off = 'a\\' c4n4ryoff3'",
        ]:
            conn.execute(text)
            psycopg.ClientCursor(conn).execute(text + "; select 1")


@pytest.mark.parametrize("mode", ["transaction", "hybrid"])
def test_canaries_never_leave_when_anonymizing(scry_proxy, tmp_path, mode: str) -> None:
    events_path = tmp_path / "events.bin"
    admin_cfg, base = admin_config()
    proxy = scry_proxy(
        {
            "pool": {"mode": mode, "size": 3},  # hybrid pins all three clients
            "log": {"level": "debug"},
            **admin_cfg,
            **events_config(events_path),
        }
    )
    with psycopg.connect(
        **proxy.conninfo(), autocommit=True, prepare_threshold=None, application_name="canary"
    ) as conn, psycopg.connect(
        **proxy.conninfo(), autocommit=True, prepare_threshold=0, application_name="canary"
    ) as prepared, psycopg.connect(
        **proxy.conninfo(), autocommit=True, application_name="canary",
        options="-c standard_conforming_strings=off -c escape_string_warning=off",
    ) as off:  # fmt: skip
        canary_workload(conn, prepared)
        canary_workload(prepared, conn)
        nonstandard_workload(off, prepared)
        conn.execute(f"set myapp.held = '{CANARY_STR}'")  # pinned in hybrid: shows in /pins
        wait_for_events(
            events_path, lambda evs: sum(e["application_name"] == "canary" for e in evs) >= 40
        )
        api = {
            path: admin_get(base, path, **params).text
            for path, params in [
                ("/metrics", {}),
                ("/api/v1/queries/top", {"limit": 1000}),
                ("/api/v1/queries/top", {"limit": 1000, "by": "errors"}),
                ("/api/v1/hot", {"limit": 1000}),
                ("/debug/hot_data", {"limit": 1000}),
                ("/api/v1/pins", {}),
                ("/api/v1/clients", {}),
                ("/api/v1/servers", {}),
                ("/api/v1/pools", {}),
                ("/api/v1/status", {}),
                ("/api/v1/breaker", {}),
            ]
        }
    proxy.stop()  # flushes everything
    events = read_all_events(events_path)
    assert any(e["application_name"] == "canary" for e in events)
    outputs = {
        "events (decoded)": json.dumps(events),
        "events file (raw)": events_path.read_bytes().decode("latin-1"),
        "events file (gunzipped)": _gunzip_frames(events_path),
        "proxy log": proxy.log_text(),
        **{f"admin {path}": text for path, text in api.items()},
    }
    leaks = [
        f"{canary!r} in {where}"
        for where, text in outputs.items()
        for canary in CANARIES
        if canary.lower() in text.lower()
    ]
    assert not leaks, "client literals leaked: " + ", ".join(leaks)
    # The statements are there, normalized.
    queries = {e["query"] for e in events}
    assert any("$" in q for q in queries), queries


def _gunzip_frames(path: Path) -> str:
    """The raw payloads of the event file, decompressed (strings as written)."""
    from scry.observe.events import FLAG_GZIP, HEADER

    data = path.read_bytes()
    out = []
    pos = 0
    while pos + HEADER.size <= len(data):
        _magic, _version, flags, _reserved, length = HEADER.unpack_from(data, pos)
        payload = data[pos + HEADER.size : pos + HEADER.size + length]
        pos += HEADER.size + length
        out.append((gzip.decompress(payload) if flags & FLAG_GZIP else payload).decode("latin-1"))
    return "\n".join(out)
