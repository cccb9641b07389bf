"""Hybrid pooling against a real PostgreSQL: isolation, pins, unpins and replay.

* A pooling-safety property test: 12 clients on a pool of 3 run random
  interleavings (``random.Random(seed)``) of session-state operations, and
  after every step every client checks that it sees exactly its own state
  (``myapp.v``, its SQL prepared statements, its temp table and its contents,
  its advisory locks) and nothing of anybody else's. A model of each client's
  session (with PostgreSQL's transaction semantics: SET and temp tables roll
  back, PREPARE and session advisory locks do not) says what "its own" is.
  In transaction mode a variant restricted to transaction-scoped state
  (SET LOCAL, ``set_config(..., true)``, xact advisory locks, ON COMMIT DROP
  temp tables) asserts the same isolation.
* Pins and unpins, observed from the outside: with ``pool.size: 1`` a second
  client can only be served while the first is not pinned.
* Replay: an idle replayable pin gives its server back after
  ``pool.idle_unpin_seconds`` and its SETs and PREPAREs follow it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import psycopg
import psycopg.errors
import pytest

# --------------------------------------------------------------------------------------
# The model of one client's session
# --------------------------------------------------------------------------------------

CHECK_SQL = """
select current_setting('myapp.v', true),
  coalesce((select array_agg(name::text order by name)
            from pg_prepared_statements where from_sql), '{}'),
  coalesce((select array_agg(relname::text order by relname) from pg_class
            where relnamespace = pg_my_temp_schema() and relkind = 'r'), '{}'),
  coalesce((select array_agg(objid::int8 order by objid) from pg_locks
            where locktype = 'advisory' and pid = pg_backend_pid() and granted), '{}')
"""


@dataclass
class Session:
    """What one client's session must look like (PostgreSQL semantics)."""

    idx: int
    var: str | None = None  # committed session value of myapp.v
    prepared: dict[str, str] = field(default_factory=dict)  # name -> value it returns
    temp: list[int] | None = None  # rows of tmp_c<idx>; None: no table
    locks: Counter[int] = field(default_factory=Counter)  # session advisory locks
    # Transaction block state
    tx: bool = False
    aborted: bool = False
    tx_var: str | None = None  # session value of myapp.v inside the block
    tx_local: str | None = None  # SET LOCAL value, if any
    tx_temp_saved: list[int] | None = None
    tx_xact_locks: set[int] = field(default_factory=set)
    tx_commit_drop: list[int] | None = None  # ON COMMIT DROP table rows
    counter: int = 0

    @property
    def table(self) -> str:
        return f"tmp_c{self.idx}"

    def fresh(self, what: str) -> str:
        self.counter += 1
        return f"{what}{self.idx}_{self.counter}"

    def lock_key(self, j: int) -> int:
        return 10_000 + self.idx * 10 + j

    @property
    def effective_var(self) -> str | None:
        if self.tx:
            return self.tx_local if self.tx_local is not None else self.tx_var
        return self.var

    @property
    def holds_state(self) -> bool:
        """Holds a server in hybrid mode (pinned or inside a transaction)."""
        return bool(
            self.tx or self.var is not None or self.prepared or self.temp is not None or self.locks
        )

    def expected_check(self) -> tuple[set[str | None], list[str], list[str], list[int]]:
        var = self.effective_var
        # A backend on which myapp.v was once set and reset reports '' (the
        # placeholder exists); one that never saw it reports NULL.
        vars_ok: set[str | None] = {var} if var is not None else {None, ""}
        tables = []
        if self.temp is not None:
            tables.append(self.table)
        if self.tx and self.tx_commit_drop is not None:
            tables.append(f"tmpx_c{self.idx}")
        locks = set(self.locks) | (self.tx_xact_locks if self.tx else set())
        return vars_ok, sorted(self.prepared), sorted(tables), sorted(locks)

    # transaction control
    def begin(self) -> None:
        self.tx = True
        self.tx_var = self.var
        self.tx_local = None
        self.tx_temp_saved = None if self.temp is None else list(self.temp)
        self.tx_xact_locks = set()
        self.tx_commit_drop = None

    def end(self, commit: bool) -> None:
        if commit and not self.aborted:
            self.var = self.tx_var
        else:
            self.temp = self.tx_temp_saved
        self.tx = self.aborted = False
        self.tx_local = None
        self.tx_xact_locks = set()
        self.tx_commit_drop = None

    def set_var(self, value: str | None) -> None:
        if self.tx:
            self.tx_var = value
            self.tx_local = None
        else:
            self.var = value


class Clients:
    """Twelve psycopg connections and their models; runs and checks steps."""

    def __init__(self, proxy, n: int) -> None:
        self.conns = [
            psycopg.connect(
                **proxy.conninfo(),
                autocommit=True,
                prepare_threshold=None,
                application_name=f"prop{i}",
            )
            for i in range(n)
        ]
        self.sessions = [Session(i) for i in range(n)]
        self.log: list[str] = []  # the steps so far, for failure messages

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def run(self, i: int, sql: str, *, simple: bool = False) -> list[tuple]:
        self.log.append(f"c{i}: {sql}")
        conn = self.conns[i]
        cur = psycopg.ClientCursor(conn) if simple else conn.cursor()
        cur.execute(sql)
        rows = cur.fetchall() if cur.description is not None else []
        return rows

    def history(self) -> str:
        return "\n".join(self.log[-40:])

    def check_all(self) -> None:
        for s in self.sessions:
            if s.aborted:
                continue  # every query fails until ROLLBACK
            conn = self.conns[s.idx]
            row = conn.execute(CHECK_SQL).fetchone()
            assert row is not None
            var, prepared, tables, locks = row
            vars_ok, want_prepared, want_tables, want_locks = s.expected_check()
            where = f"client {s.idx} after:\n{self.history()}"
            assert var in vars_ok, f"myapp.v is {var!r}, expected one of {vars_ok}; {where}"
            assert list(prepared) == want_prepared, f"prepared {prepared}; {where}"
            assert list(tables) == want_tables, f"temp tables {tables}; {where}"
            assert [int(x) for x in locks] == want_locks, f"advisory locks {locks}; {where}"
            if s.temp is not None:
                (rows,) = conn.execute(f"select coalesce(array_agg(v order by v), '{{}}') "
                                       f"from {s.table}").fetchone()  # fmt: skip
                assert list(rows) == sorted(s.temp), f"{s.table} rows {rows}; {where}"
            if s.tx and s.tx_commit_drop is not None:
                (rows,) = conn.execute(f"select coalesce(array_agg(v order by v), '{{}}') "
                                       f"from tmpx_c{s.idx}").fetchone()  # fmt: skip
                assert list(rows) == sorted(s.tx_commit_drop), f"tmpx rows {rows}; {where}"


# --------------------------------------------------------------------------------------
# Hybrid: every kind of session state
# --------------------------------------------------------------------------------------

MAX_HOLDERS = 2  # pool of 3: one server always left for the clients holding nothing


def hybrid_ops(s: Session, holders: int) -> list[str]:
    """The operations client ``s`` may do now without starving the pool."""
    if s.aborted:
        return ["end"]
    may_grab = s.holds_state or holders < MAX_HOLDERS
    ops = ["plain"]
    if s.prepared:
        ops += ["execute", "deallocate"]
    if s.temp is not None:
        ops += ["temp_insert", "temp_insert", "temp_drop"]
    if s.locks:
        ops += ["unlock", "unlock_all"]
    if s.var is not None or (s.tx and s.tx_var is not None):
        ops += ["reset_all", "reset_all"]
    if s.tx:
        ops += ["end", "end", "end", "set", "set_local", "fail_in_tx"]
        if s.temp is None:
            ops += ["temp_create"]
        ops += ["prepare", "lock"]
    else:
        ops += ["failing_multi"]
        if s.holds_state:
            ops += ["discard_all", "discard_all"]
        if may_grab:
            ops += ["set", "set", "set_config", "prepare", "lock", "begin", "begin"]
            if s.temp is None:
                ops += ["temp_create"]
    return ops


def pick(c: Clients, rng: random.Random) -> Session:
    """A client; half the time one holding state (the few that do matter most)."""
    holding = [s for s in c.sessions if s.holds_state]
    if holding and rng.random() < 0.5:
        return rng.choice(holding)
    return rng.choice(c.sessions)


def hybrid_step(c: Clients, rng: random.Random) -> None:
    holders = sum(s.holds_state for s in c.sessions)
    s = pick(c, rng)
    i = s.idx
    op = rng.choice(hybrid_ops(s, holders))
    if op == "plain":
        assert c.run(i, f"select {i} + 1000") == [(i + 1000,)]
    elif op == "set":
        value = s.fresh("v")
        c.run(i, f"SET myapp.v = '{value}'")
        s.set_var(value)
    elif op == "set_config":
        value = s.fresh("w")
        assert c.run(i, f"select set_config('myapp.v', '{value}', false)") == [(value,)]
        s.set_var(value)
    elif op == "set_local":
        value = s.fresh("l")
        c.run(i, f"SET LOCAL myapp.v = '{value}'")
        s.tx_local = value
    elif op == "reset_all":
        c.run(i, "RESET ALL")
        s.set_var(None)
    elif op == "prepare":
        name = s.fresh("p")
        c.run(i, f"PREPARE {name} AS SELECT '{name}-value'::text")
        s.prepared[name] = f"{name}-value"
    elif op == "execute":
        name = rng.choice(sorted(s.prepared))
        assert c.run(i, f"EXECUTE {name}") == [(s.prepared[name],)]
    elif op == "deallocate":
        name = rng.choice(sorted(s.prepared))
        c.run(i, f"DEALLOCATE {name}")
        del s.prepared[name]
    elif op == "temp_create":
        c.run(i, f"CREATE TEMP TABLE {s.table} (v int)")
        s.temp = []
    elif op == "temp_insert":
        v = rng.randrange(1000)
        c.run(i, f"INSERT INTO {s.table} VALUES ({v})")
        assert s.temp is not None
        s.temp.append(v)
    elif op == "temp_drop":
        c.run(i, f"DROP TABLE {s.table}")
        s.temp = None
    elif op == "lock":
        key = s.lock_key(rng.randrange(3))
        c.run(i, f"select pg_advisory_lock({key})")
        s.locks[key] += 1
    elif op == "unlock":
        key = rng.choice(sorted(s.locks))
        assert c.run(i, f"select pg_advisory_unlock({key})") == [(True,)]
        s.locks[key] -= 1
        if not s.locks[key]:
            del s.locks[key]
    elif op == "unlock_all":
        c.run(i, "select pg_advisory_unlock_all()")
        s.locks.clear()
    elif op == "begin":
        c.run(i, "BEGIN")
        s.begin()
    elif op == "end":
        commit = rng.random() < 0.5
        c.run(i, "COMMIT" if commit else "ROLLBACK")
        s.end(commit)
    elif op == "fail_in_tx":
        with pytest.raises(psycopg.errors.DivisionByZero):
            c.run(i, "select 1/0")
        s.aborted = True
    elif op == "failing_multi":
        # One Query, an implicit transaction: the SET is rolled back with it.
        with pytest.raises(psycopg.errors.DivisionByZero):
            c.run(i, f"SET myapp.v = '{s.fresh('x')}'; SELECT 1/0", simple=True)
    elif op == "discard_all":
        c.run(i, "DISCARD ALL")
        s.var = None
        s.prepared.clear()
        s.temp = None
        s.locks.clear()
    else:  # pragma: no cover
        raise AssertionError(op)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hybrid_isolation_property(scry_proxy, seed: int) -> None:
    proxy = scry_proxy(
        {"pool": {"mode": "hybrid", "size": 3}, "timeouts": {"query_wait_timeout": 5}}
    )
    rng = random.Random(seed)
    clients = Clients(proxy, 12)
    try:
        clients.check_all()
        for _ in range(100):
            hybrid_step(clients, rng)
            clients.check_all()
        # Wind down: every client ends its transaction and drops its state,
        # then sees a clean session.
        for s in clients.sessions:
            if s.tx:
                clients.run(s.idx, "ROLLBACK")
                s.end(False)
            clients.run(s.idx, "DISCARD ALL")
            s.var, s.temp = None, None
            s.prepared.clear()
            s.locks.clear()
        clients.check_all()
    finally:
        clients.close()


# --------------------------------------------------------------------------------------
# Transaction mode: transaction-scoped state only
# --------------------------------------------------------------------------------------


def transaction_step(c: Clients, rng: random.Random) -> None:
    in_tx = sum(s.tx for s in c.sessions)
    s = pick(c, rng)
    i = s.idx
    if s.aborted:
        ops = ["end"]
    elif s.tx:
        ops = ["plain", "set_local", "set_config_local", "xact_lock", "end", "end", "fail_in_tx"]
        if s.tx_commit_drop is None:
            ops.append("commit_drop_create")
        else:
            ops.append("commit_drop_insert")
    else:
        ops = ["plain", "autocommit_set_config"]
        if in_tx < MAX_HOLDERS:
            ops += ["begin", "begin"]
    op = rng.choice(ops)
    if op == "plain":
        assert c.run(i, f"select {i} + 2000") == [(i + 2000,)]
    elif op == "begin":
        c.run(i, "BEGIN")
        s.begin()
    elif op == "end":
        commit = rng.random() < 0.5
        c.run(i, "COMMIT" if commit else "ROLLBACK")
        s.end(commit)
    elif op == "set_local":
        value = s.fresh("l")
        c.run(i, f"SET LOCAL myapp.v = '{value}'")
        s.tx_local = value
    elif op == "set_config_local":
        value = s.fresh("t")
        assert c.run(i, f"select set_config('myapp.v', '{value}', true)") == [(value,)]
        s.tx_local = value
    elif op == "autocommit_set_config":
        # Its own implicit transaction: gone when the statement ends.
        value = s.fresh("a")
        assert c.run(i, f"select set_config('myapp.v', '{value}', true)") == [(value,)]
    elif op == "xact_lock":
        key = s.lock_key(rng.randrange(3))
        c.run(i, f"select pg_advisory_xact_lock({key})")
        s.tx_xact_locks.add(key)
    elif op == "commit_drop_create":
        c.run(i, f"CREATE TEMP TABLE tmpx_c{i} (v int) ON COMMIT DROP")
        s.tx_commit_drop = []
    elif op == "commit_drop_insert":
        v = rng.randrange(1000)
        c.run(i, f"INSERT INTO tmpx_c{i} VALUES ({v})")
        assert s.tx_commit_drop is not None
        s.tx_commit_drop.append(v)
    elif op == "fail_in_tx":
        with pytest.raises(psycopg.errors.DivisionByZero):
            c.run(i, "select 1/0")
        s.aborted = True
    else:  # pragma: no cover
        raise AssertionError(op)


@pytest.mark.parametrize("seed", [11, 12])
def test_transaction_mode_isolation_property(scry_proxy, seed: int) -> None:
    proxy = scry_proxy(
        {"pool": {"mode": "transaction", "size": 3}, "timeouts": {"query_wait_timeout": 5}}
    )
    rng = random.Random(seed)
    clients = Clients(proxy, 12)
    try:
        clients.check_all()
        for _ in range(70):
            transaction_step(clients, rng)
            clients.check_all()
    finally:
        clients.close()


# --------------------------------------------------------------------------------------
# Pins and unpins, seen from a second client on a pool of one server
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_server_proxy(scry_proxy_module):
    return scry_proxy_module(
        {"pool": {"mode": "hybrid", "size": 1}, "timeouts": {"query_wait_timeout": 5}}
    )


async def aconnect(proxy, **kwargs) -> psycopg.AsyncConnection:
    kwargs.setdefault("autocommit", True)
    kwargs.setdefault("prepare_threshold", None)
    return await psycopg.AsyncConnection.connect(**proxy.conninfo(), **kwargs)


async def run_sql(conn: psycopg.AsyncConnection, sql: str, simple: bool = False) -> None:
    cur = psycopg.AsyncClientCursor(conn) if simple else conn.cursor()
    await cur.execute(sql)


BLOCKED_FOR = 0.4  # how long B must stay unserved to call A pinned


async def b_is_blocked(b: psycopg.AsyncConnection) -> asyncio.Task:
    """Start a query on B and check that it is not served within BLOCKED_FOR seconds."""
    task = asyncio.create_task(b.execute("select 'served'"))
    done, _ = await asyncio.wait({task}, timeout=BLOCKED_FOR)
    assert not done, "B was served: A did not keep (was not pinned to) the only server"
    return task


async def b_is_served(b: psycopg.AsyncConnection, task: asyncio.Task | None = None) -> None:
    if task is None:
        task = asyncio.create_task(b.execute("select 'served'"))
    cur = await asyncio.wait_for(task, 3)
    assert await cur.fetchone() == ("served",)


# (pin statements, simple protocol?, statements that must keep the pin, unpin statements)
PIN_CASES = {
    "set": (["SET myapp.v = 'x'"], False, [], ["RESET ALL"]),
    "set_to_default": (["SET myapp.v TO 'x'"], False, [], ["SET myapp.v TO DEFAULT"]),
    "set_config_false": (["SELECT set_config('myapp.v', 'x', false)"], False, [], ["RESET ALL"]),
    "set_in_committed_tx": (["BEGIN", "SET myapp.v = 'x'", "COMMIT"], False, [], ["RESET myapp.v"]),
    "multi_statement": (["SELECT 1; SET x.y = 1"], True, [], ["RESET ALL"]),
    # With standard_conforming_strings off, \\' does not end a literal.
    "nonstandard_strings": (
        ["SET standard_conforming_strings = off", "SELECT 'it\\'s'; SET x.y = 1"],
        True,
        [],
        ["RESET x.y"],
    ),
    "prepare": (["PREPARE pin_p AS SELECT 1"], False, ["EXECUTE pin_p"], ["DEALLOCATE pin_p"]),
    "temp_table": (
        ["CREATE TEMP TABLE pin_t (a int)"],
        False,
        ["INSERT INTO pin_t VALUES (1)", "RESET ALL", "SELECT * FROM pin_t"],
        ["DROP TABLE pin_t"],
    ),
    "advisory_lock": (
        ["SELECT pg_advisory_lock(4242)", "SELECT pg_advisory_lock(4243)"],
        False,
        ["SELECT pg_advisory_unlock(4242)"],  # one lock still held
        ["SELECT pg_advisory_unlock_all()"],
    ),
    "listen": (["LISTEN pin_channel"], False, ["NOTIFY pin_channel"], ["UNLISTEN *"]),
    "with_hold_cursor": (
        ["DECLARE pin_c CURSOR WITH HOLD FOR SELECT 1"],
        False,
        [],
        ["CLOSE pin_c"],
    ),
}


@pytest.mark.parametrize("case", sorted(PIN_CASES))
async def test_pin_and_unpin(single_server_proxy, case: str) -> None:
    pins, simple, keep, unpins = PIN_CASES[case]
    a = await aconnect(single_server_proxy)
    b = await aconnect(single_server_proxy)
    try:
        await b_is_served(b)  # not pinned yet: both share the one server
        for sql in pins:
            await run_sql(a, sql, simple)
        task = await b_is_blocked(b)
        for sql in keep:
            await run_sql(a, sql)
            done, _ = await asyncio.wait({task}, timeout=0.2)
            assert not done, f"{sql!r} released A's pin"
        for sql in unpins:
            await run_sql(a, sql)
        await b_is_served(b, task)
        # ... and A's next query takes the server back from B.
        cur = await asyncio.wait_for(a.execute("select 'a again'"), 3)
        assert await cur.fetchone() == ("a again",)
    finally:
        await a.close()
        await b.close()


NO_PIN_CASES = {
    "set_local": (["BEGIN", "SET LOCAL myapp.v = 'x'", "COMMIT"], False),
    "set_config_true": (["SELECT set_config('myapp.v', 'x', true)"], False),
    "set_in_rolled_back_tx": (["BEGIN", "SET myapp.v = 'x'", "ROLLBACK"], False),
    "string_literal": (["SELECT 'SET x = 1'"], False),
    "string_with_semicolon": (["SELECT 'a; SET x.y = 1'"], True),
    "nonstandard_string": (
        ["SET standard_conforming_strings = off", "SELECT 'a\\'; SET x.y = 1; --'"],
        True,
    ),
    "dollar_quote": (["SELECT $$SET x.y = 1$$"], False),
    "dollar_quote_tagged": (["SELECT $q$; SET x.y = 1; $q$"], True),
    "block_comment": (["/* SET x.y = 1; */ SELECT 1"], True),
    "line_comment": (["-- SET x.y = 1;\nSELECT 1"], True),
    "quoted_identifier": (['SELECT 1 AS "SET x.y = 1"'], False),
    "xact_advisory_lock": (["BEGIN", "SELECT pg_advisory_xact_lock(4244)", "COMMIT"], False),
    "temp_on_commit_drop": (
        ["BEGIN", "CREATE TEMP TABLE pin_d (a int) ON COMMIT DROP", "COMMIT"],
        False,
    ),
    "set_then_reset_in_one_query": (["SET x.y = 1; RESET x.y"], True),
}


@pytest.mark.parametrize("case", sorted(NO_PIN_CASES))
async def test_no_pin(single_server_proxy, case: str) -> None:
    statements, simple = NO_PIN_CASES[case]
    a = await aconnect(single_server_proxy)
    b = await aconnect(single_server_proxy)
    try:
        for sql in statements:
            await run_sql(a, sql, simple)
        await b_is_served(b)
    finally:
        await a.close()
        await b.close()


async def test_pinned_client_keeps_its_backend(scry_proxy, admin_dsn) -> None:
    """pg_stat_activity: nobody else runs anything on a pinned client's backend."""
    proxy = scry_proxy({"pool": {"mode": "hybrid", "size": 3}})
    a = await aconnect(proxy, application_name="pin_a")
    others = [await aconnect(proxy, application_name=f"pin_o{i}") for i in range(4)]
    try:
        await a.execute("SET myapp.v = 'mine'")
        a_pid = (await (await a.execute("select pg_backend_pid()")).fetchone())[0]
        other_pids = set()
        for _ in range(5):
            for conn in others:
                cur = await conn.execute(
                    "select pg_backend_pid(), current_setting('myapp.v', true)"
                )
                pid, value = await cur.fetchone()
                assert value in (None, ""), "another client saw A's SET"
                other_pids.add(pid)
        assert a_pid not in other_pids
        async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as admin:
            cur = await admin.execute(
                "select query, state from pg_stat_activity where pid = %s", (a_pid,)
            )
            row = await cur.fetchone()
        assert row is not None, "A's backend is gone"
        assert row[0] == "select pg_backend_pid()" and row[1] == "idle", row
        cur = await a.execute("select pg_backend_pid(), current_setting('myapp.v')")
        assert await cur.fetchone() == (a_pid, "mine")
    finally:
        await a.close()
        for conn in others:
            await conn.close()


# --------------------------------------------------------------------------------------
# Replay after idle_unpin_seconds
# --------------------------------------------------------------------------------------


async def test_idle_pin_is_released_and_replayed(scry_proxy) -> None:
    proxy = scry_proxy(
        {
            "pool": {"mode": "hybrid", "size": 1, "idle_unpin_seconds": 1.0},
            "timeouts": {"query_wait_timeout": 10},
        }
    )
    a = await aconnect(proxy)
    b = await aconnect(proxy)
    try:
        await b_is_served(b)
        await a.execute("SET myapp.v = 'alpha'")
        await a.execute("SELECT set_config('myapp.w', 'omega', false)")
        await a.execute("PREPARE replay_p (int) AS SELECT $1 * 2, current_setting('myapp.v')")
        # B cannot be served while A holds the only server...
        task = asyncio.create_task(
            b.execute(
                "select current_setting('myapp.v', true), current_setting('myapp.w', true),"
                " (select count(*) from pg_prepared_statements where from_sql)"
            )
        )
        done, _ = await asyncio.wait({task}, timeout=0.5)
        assert not done, "B was served while A was pinned"
        # ... until A has idled past idle_unpin_seconds (janitor: once a second).
        cur = await asyncio.wait_for(task, 5)
        v, w, prepared = await cur.fetchone()
        assert v in (None, "") and w in (None, "") and prepared == 0, (
            "the server reached B without its reset"
        )
        # A's state comes back on whatever server serves it next.
        cur = await asyncio.wait_for(a.execute("EXECUTE replay_p(21)"), 5)
        assert await cur.fetchone() == (42, "alpha")
        cur = await a.execute("SHOW myapp.v")
        assert await cur.fetchone() == ("alpha",)
        cur = await a.execute("select current_setting('myapp.w')")
        assert await cur.fetchone() == ("omega",)
        # Still pinned after the replay: B waits again.
        task = await b_is_blocked(b)
        await a.execute("DEALLOCATE replay_p")
        await a.execute("RESET ALL")
        await b_is_served(b, task)
    finally:
        await a.close()
        await b.close()
    assert "pinned client released its server" in proxy.log_text()


async def test_non_replayable_pin_is_not_released(scry_proxy) -> None:
    """A temp table cannot move: the pin outlives idle_unpin_seconds."""
    proxy = scry_proxy(
        {
            "pool": {"mode": "hybrid", "size": 1, "idle_unpin_seconds": 0.5},
            "timeouts": {"query_wait_timeout": 10},
        }
    )
    a = await aconnect(proxy)
    b = await aconnect(proxy)
    try:
        await a.execute("SET myapp.v = 'alpha'")
        await a.execute("CREATE TEMP TABLE keep_me (a int)")
        await a.execute("INSERT INTO keep_me VALUES (7)")
        task = asyncio.create_task(b.execute("select 'served'"))
        done, _ = await asyncio.wait({task}, timeout=2.0)  # > 0.5 s + two janitor ticks
        assert not done, "a client with a temp table lost its server"
        cur = await a.execute("select a, current_setting('myapp.v') from keep_me")
        assert await cur.fetchone() == (7, "alpha")
        await a.execute("DROP TABLE keep_me")
        await a.execute("RESET ALL")
        await b_is_served(b, task)
    finally:
        await a.close()
        await b.close()
