"""Differential tests: PgBouncer and scry-pgbouncer from the same pgbouncer.ini.

Both read the same ini and userlist (only the ports, socket directory, log and
pid files differ); the same client scripts and console commands run against
both. What clients see must match; SHOW column names and types must match
PgBouncer's where PgBouncer (the installed one, Debian's 1.18) has the column;
deterministic values (SHOW DATABASES, SHOW CONFIG) must match.

PgBouncer refuses to run as root: as root it is started as user ``postgres``.
Without ``/usr/sbin/pgbouncer`` (``apt-get install pgbouncer``) the
PgBouncer side is skipped and scry is checked against the expected 1.25 columns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest

from scry.devcluster import DevCluster, free_port

REPO = Path(__file__).resolve().parents[2]
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
HAVE_PGBOUNCER = os.path.exists(PGBOUNCER)

INI = """\
;; the same file for PgBouncer and scry (ports and paths filled in per process)
[databases]
app = host=127.0.0.1 port={pg_port} dbname=app
forced = host=127.0.0.1 port={pg_port} dbname=app user=app password=app_pass pool_size=3
spread = host=127.0.0.1,localhost port={pg_port} dbname=app

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir = {dir}
auth_type = md5
auth_file = {dir}/userlist.txt
admin_users = admin
stats_users = stats
pool_mode = transaction
default_pool_size = 4
max_client_conn = 50
logfile = {dir}/{name}.log
pidfile = {dir}/{name}.pid
"""
USERLIST = '"app" "app_pass"\n"admin" "admin_pass"\n"stats" "stats_pass"\n'

# PgBouncer 1.25's columns (scry sends these exactly).
EXPECTED_COLUMNS = {
    "SHOW POOLS": "database user cl_active cl_waiting cl_active_cancel_req cl_waiting_cancel_req "
    "sv_active sv_active_cancel sv_being_canceled sv_idle sv_used sv_tested sv_login maxwait "
    "maxwait_us pool_mode load_balance_hosts",
    "SHOW CLIENTS": "type user database replication state addr port local_addr local_port "
    "connect_time request_time wait wait_us close_needed ptr link remote_pid tls "
    "application_name prepared_statements id",
    "SHOW DATABASES": "name host port database force_user pool_size min_pool_size "
    "reserve_pool_size server_lifetime pool_mode load_balance_hosts max_connections "
    "current_connections max_client_connections current_client_connections paused disabled",
    "SHOW STATS": "database total_server_assignment_count total_xact_count total_query_count "
    "total_received total_sent total_xact_time total_query_time total_wait_time "
    "total_client_parse_count total_server_parse_count total_bind_count "
    "avg_server_assignment_count avg_xact_count avg_query_count avg_recv avg_sent "
    "avg_xact_time avg_query_time avg_wait_time avg_client_parse_count "
    "avg_server_parse_count avg_bind_count",
    "SHOW USERS": "name pool_size reserve_pool_size pool_mode max_user_connections "
    "current_connections max_user_client_connections current_client_connections",
    "SHOW LISTS": "list items",
    "SHOW CONFIG": "key value default changeable",
    "SHOW STATE": "key value",
    "SHOW VERSION": "version",
    "SHOW TOTALS": "name value",
    "SHOW PEERS": "peer_id host port pool_size",
}
# Columns PgBouncer renamed after 1.18 (1.18 name -> 1.25 name).
RENAMED = {"reserve_pool": "reserve_pool_size"}
SHOWS = [
    "SHOW POOLS", "SHOW CLIENTS", "SHOW SERVERS", "SHOW DATABASES", "SHOW STATS",
    "SHOW STATS_TOTALS", "SHOW STATS_AVERAGES", "SHOW TOTALS", "SHOW LISTS", "SHOW USERS",
    "SHOW CONFIG", "SHOW SOCKETS", "SHOW VERSION",
]  # fmt: skip


class Bouncer:
    """A running pooler (PgBouncer or scry-pgbouncer) on its own port."""

    def __init__(self, kind: str, pg: DevCluster, directory: Path) -> None:
        self.kind = kind
        self.pg = pg
        self.dir = directory
        self.port = free_port()
        self.ini = directory / f"{kind}.ini"
        self.write_ini()
        self.proc: subprocess.Popen[bytes] | None = None

    def write_ini(self, extra: str = "") -> None:
        text = INI.format(pg_port=self.pg.port, port=self.port, dir=self.dir, name=self.kind)
        self.ini.write_text(
            text.replace("max_client_conn = 50\n", f"max_client_conn = 50\n{extra}")
        )
        _chown(self.ini)

    def start(self, *args: str, as_root: bool = False) -> None:
        """Start it (``args`` go before the ini). ``as_root``: PgBouncer too is
        started as root, for an ini whose ``user`` it switches to."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
        as_user: dict[str, object] = {}
        if self.kind == "pgbouncer":
            cmd = [PGBOUNCER, *args, str(self.ini)]
            if os.getuid() == 0 and not as_root:
                # PgBouncer refuses root. Switch user in the child itself (not via
                # runuser) so that our signals reach PgBouncer and it really stops.
                as_user = {"user": "postgres", "group": "postgres", "extra_groups": []}
        else:
            env["SCRY_ADMIN__ENABLED"] = "false"  # no HTTP admin port to collide on
            cmd = [sys.executable, "-m", "scry.pgbouncer.cli", *args, str(self.ini)]
        out = open(self.dir / f"{self.kind}.out", "ab")  # noqa: SIM115 - closed in stop()
        self._out = out
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=out,
            **as_user,  # type: ignore[call-overload]
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{self.kind} did not start:\n{self.output()}")
                time.sleep(0.05)

    def output(self) -> str:
        return (self.dir / f"{self.kind}.out").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()

    def connect(self, user: str = "app", password: str | None = "app_pass", dbname: str = "app"):
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=user, password=password, dbname=dbname,
            sslmode="disable", connect_timeout=10, autocommit=True,
        )  # fmt: skip

    def admin(self, sql: str, user: str = "admin", password: str = "admin_pass") -> Any:
        """(columns [(name, type oid)], rows, status) or ("error", sqlstate, message)."""
        with self.connect(user, password, "pgbouncer") as conn:
            conn.prepare_threshold = None
            cur = conn.cursor()
            try:
                cur.execute(sql, prepare=False)
            except psycopg.Error as exc:
                return ("error", exc.diag.sqlstate, exc.diag.message_primary)
            columns = [(c.name, c.type_code) for c in cur.description or []]
            rows = cur.fetchall() if cur.description else []
            return columns, rows, cur.statusmessage


def _chown(path: Path) -> None:
    if os.getuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)


@contextlib.contextmanager
def bouncer_dir() -> Iterator[Path]:
    """A directory for the ini, userlist, sockets and logs of both poolers."""
    # Not tmp_path: PgBouncer runs as postgres and must reach the files.
    directory = Path(tempfile.mkdtemp(prefix="scry-pgb-"))
    directory.chmod(0o755)
    _chown(directory)
    (directory / "userlist.txt").write_text(USERLIST)
    _chown(directory / "userlist.txt")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def running(kind: str, pg: DevCluster, directory: Path, extra: str = "") -> Iterator[Bouncer]:
    """PgBouncer (``kind="pgbouncer"``) or scry-pgbouncer, started and stopped."""
    if kind == "pgbouncer" and not HAVE_PGBOUNCER:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    bouncer = Bouncer(kind, pg, directory)
    if extra:
        bouncer.write_ini(extra)
    with running_bouncer(bouncer):
        yield bouncer


@contextlib.contextmanager
def running_bouncer(bouncer: Bouncer) -> Iterator[Bouncer]:
    """``bouncer`` (its ini written), started and stopped."""
    if bouncer.kind == "pgbouncer" and not HAVE_PGBOUNCER:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()
    if bouncer.kind == "scry":
        assert "Traceback" not in bouncer.output(), bouncer.output()


@pytest.fixture
def workdir() -> Iterator[Path]:
    with bouncer_dir() as directory:
        yield directory


@pytest.fixture
def scry_bouncer(pg: DevCluster, workdir: Path) -> Iterator[Bouncer]:
    with running("scry", pg, workdir) as bouncer:
        yield bouncer


@pytest.fixture
def both(pg: DevCluster, workdir: Path, scry_bouncer: Bouncer) -> Iterator[tuple[Bouncer, Bouncer]]:
    with running("pgbouncer", pg, workdir) as real:
        yield real, scry_bouncer


def _client_script(bouncer: Bouncer) -> list[Any]:
    """What an application sees: results, statuses and errors."""
    seen: list[Any] = []
    with bouncer.connect() as conn:
        seen.append(conn.execute("select 1 + 1").fetchone())
        with conn.transaction():
            seen.append(conn.execute("select current_database()").fetchone())
        try:
            conn.execute("select 1/0")
        except psycopg.Error as exc:
            seen.append(("error", exc.diag.sqlstate, exc.diag.message_primary))
    with bouncer.connect(dbname="forced") as conn:
        seen.append(conn.execute("select current_user").fetchone())
    # A host list: two servers at once, one on each host (round-robin).
    spread = [bouncer.connect(dbname="spread") for _ in range(2)]
    for conn in spread:
        conn.execute("begin")
        seen.append(conn.execute("select current_database()").fetchone())
    for conn in spread:
        conn.execute("commit")
        conn.close()
    for user, password, db in (("app", "app_pass", "nosuch"), ("app", "wrong", "app")):
        try:
            bouncer.connect(user, password, db).close()
        except psycopg.OperationalError as exc:
            seen.append(("cannot connect", _fatal_message(str(exc))))
    return seen


def _fatal_message(text: str) -> str:
    message = text.rpartition("FATAL:")[2].strip().splitlines()[0] if "FATAL:" in text else text
    # Known difference (docs/migrating-from-pgbouncer.md): scry names the user, as
    # PostgreSQL does; PgBouncer 1.15+ does not.
    return re.sub(r' for user "[^"]*"$', "", message)


# --------------------------------------------------------------------------- #
# Differential
# --------------------------------------------------------------------------- #


def test_clients_see_the_same_thing(both: tuple[Bouncer, Bouncer]) -> None:
    real, scry = both
    assert _client_script(scry) == _client_script(real)


def test_a_users_line_applies_to_the_pools_user_not_the_clients(pg: DevCluster, wait_until) -> None:
    """[users] settings belong to a pool's user, as in PgBouncer: a client
    logging in as stats to `forced` (whose server user is app) shares app's
    pool, which stats's line (max_user_connections=1) does not limit."""
    for kind in ("pgbouncer", "scry"):
        with bouncer_dir() as directory:
            bouncer = Bouncer(kind, pg, directory)
            bouncer.ini.write_text(
                bouncer.ini.read_text() + "[users]\nstats = max_user_connections=1\n"
            )
            with running_bouncer(bouncer):
                _two_transactions_get_two_servers(bouncer, wait_until)


def _two_transactions_get_two_servers(bouncer: Bouncer, wait_until) -> None:
    first, second = (bouncer.connect("stats", "stats_pass", "forced") for _ in "12")
    first.execute("begin")
    first.execute("select 1")
    second.execute("begin")
    thread = threading.Thread(target=second.execute, args=("select 2",), daemon=True)
    thread.start()

    def forced_servers_active() -> bool:
        columns, rows, _ = bouncer.admin("SHOW POOLS")
        names = [name for name, _ in columns]
        db, active = names.index("database"), names.index("sv_active")
        return any(row[db] == "forced" and row[active] == 2 for row in rows)

    wait_until(forced_servers_active, 10, what=f"{bouncer.kind}: two servers for forced")
    thread.join(10)
    first.close()
    second.close()


def _query_from_a_new_pool(bouncer: Bouncer, answer: list[Any]) -> None:
    with bouncer.connect(dbname="forced") as conn:  # (a pool with no server yet)
        answer.append(conn.execute("select 2").fetchone())


def test_suspend_holds_new_clients_until_resume(both: tuple[Bouncer, Bouncer]) -> None:
    """SUSPEND answers once nothing is left to send; a client that connects
    while suspended is served only after RESUME (from the session that ran
    SUSPEND: PgBouncer takes no new connection meanwhile), and a client that
    was connected before goes on."""
    for bouncer in both:
        before = bouncer.connect()
        before.execute("select 1")
        with bouncer.connect("admin", "admin_pass", "pgbouncer") as admin:
            admin.prepare_threshold = None
            assert admin.execute("SUSPEND", prepare=False).statusmessage == "SUSPEND"
            answer: list[Any] = []
            thread = threading.Thread(target=_query_from_a_new_pool, args=(bouncer, answer))
            thread.start()
            thread.join(1.0)  # (what must not happen has no event to await)
            assert thread.is_alive() and not answer, bouncer.kind
            assert admin.execute("RESUME", prepare=False).statusmessage == "RESUME"
            thread.join(10)
            assert answer == [(2,)], bouncer.kind
        assert before.execute("select 3").fetchone() == (3,)
        before.close()


def test_a_host_name_is_looked_up_and_kept_as_pgbouncer_does(
    both: tuple[Bouncer, Bouncer],
) -> None:
    """spread's second host is a name (localhost): the connection that takes
    it looks it up, and SHOW DNS_HOSTS lists it with its address for up to
    dns_max_ttl (15 s); SHOW LISTS counts it."""
    for bouncer in both:
        spread = [bouncer.connect(dbname="spread") for _ in range(2)]  # one server per host
        for conn in spread:
            conn.execute("begin")
            conn.execute("select 1")
        for conn in spread:
            conn.execute("commit")
            conn.close()
    addresses = []
    for bouncer in both:
        (row,) = bouncer.admin("SHOW DNS_HOSTS")[1]
        hostname, ttl, addrs = row
        assert hostname == "localhost" and 0 <= int(ttl) <= 15, (bouncer.kind, row)
        assert "127.0.0.1:0" in addrs.split(","), (bouncer.kind, row)
        addresses.append(sorted(addrs.split(",")))
        lists = dict(bouncer.admin("SHOW LISTS")[1])
        assert (lists["dns_names"], lists["dns_pending"]) == (1, 0), (bouncer.kind, lists)
    assert addresses[0] == addresses[1]  # the same addresses, written the same way


def test_show_columns_match_pgbouncer(both: tuple[Bouncer, Bouncer]) -> None:
    real, scry = both
    with real.connect(), scry.connect():  # one client each, so the lists are not empty
        for sql in SHOWS:
            theirs, ours = real.admin(sql), scry.admin(sql)
            assert ours[0] != "error", (sql, ours)
            ours_types = dict(ours[0])
            order = [name for name, _ in ours[0]]
            previous = -1
            for name, oid in theirs[0]:
                name = RENAMED.get(name, name)
                if name not in ours_types:
                    continue  # a column PgBouncer 1.25 no longer has (total_requests, ...)
                assert ours_types[name] == oid, (sql, name, ours_types[name], oid)
                assert order.index(name) > previous, (sql, "column order", name)
                previous = order.index(name)


def test_deterministic_values_match(both: tuple[Bouncer, Bouncer]) -> None:
    real, scry = both

    def databases(b: Bouncer) -> dict[str, tuple[Any, ...]]:
        columns, rows, _ = b.admin("SHOW DATABASES")
        names = [c for c, _ in columns]
        keep = ("host", "database", "force_user", "pool_size", "min_pool_size", "pool_mode")
        return {r[0]: tuple(r[names.index(k)] for k in keep) for r in rows}

    assert databases(scry) == databases(real)

    def config(b: Bouncer) -> dict[str, str]:
        _, rows, _ = b.admin("SHOW CONFIG")
        return {r[0]: r[1] for r in rows}

    ours, theirs = config(scry), config(real)
    for key in ("pool_mode", "default_pool_size", "max_client_conn", "auth_type",
                "admin_users", "stats_users", "server_reset_query", "query_wait_timeout"):  # fmt: skip
        assert ours[key] == theirs[key], key
    _, rows, _ = scry.admin("SHOW POOLS")
    _, their_rows, _ = real.admin("SHOW POOLS")
    assert {r[0]: r[-2] for r in rows} == {r[0]: r[-1] for r in their_rows}  # pool_mode


def test_console_errors_match(both: tuple[Bouncer, Bouncer]) -> None:
    real, scry = both
    for sql in ("SHOW FOO", "FOO", "select 1", "SHOW", "PAUSE nosuch", "DISABLE",
                "RESUME", "SET nosuch = 1"):  # fmt: skip
        assert scry.admin(sql) == real.admin(sql), sql
    for sql in ("PAUSE", "SET query_timeout = 1", "RELOAD"):
        assert scry.admin(sql, "stats", "stats_pass") == real.admin(sql, "stats", "stats_pass")
    assert scry.admin("SHOW POOLS", "stats", "stats_pass")[0] != "error"  # stats users may SHOW
    messages = []
    for b in (real, scry):
        with pytest.raises(psycopg.OperationalError) as info:
            b.admin("SHOW POOLS", "app", "app_pass")
        messages.append(_fatal_message(str(info.value)))
    assert messages[0] == messages[1] == "not allowed"
    # Faked settings, as PgBouncer fakes them for drivers that ask.
    assert scry.admin("SHOW client_encoding")[1] == real.admin("SHOW client_encoding")[1]


# --------------------------------------------------------------------------- #
# scry alone
# --------------------------------------------------------------------------- #


def test_scry_columns_are_pgbouncer_125s(scry_bouncer: Bouncer) -> None:
    with scry_bouncer.connect():
        for sql, expected in EXPECTED_COLUMNS.items():
            columns = scry_bouncer.admin(sql)[0]
            assert [c for c, _ in columns] == expected.split(), sql


def test_pause_resume_disable_enable(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    with b.connect() as conn:
        conn.execute("select 1")
        assert b.admin("PAUSE app")[2] == "PAUSE"
        states = {r[0]: r[-2] for r in b.admin("SHOW DATABASES")[1]}
        assert states["app"] == 1
        assert b.admin("RESUME app")[2] == "RESUME"
        assert b.admin("RESUME app")[1:] == ("08P01", "database app is not paused")
        conn.execute("select 1")
        assert b.admin("PAUSE")[2] == "PAUSE"
        assert dict(b.admin("SHOW STATE")[1])["paused"] == "yes"
        assert b.admin("PAUSE")[1:] == ("08P01", "already suspended/paused")
        assert b.admin("RESUME")[2] == "RESUME"
        conn.execute("select 1")
    assert b.admin("DISABLE app")[2] == "DISABLE"
    with pytest.raises(psycopg.OperationalError, match="does not allow connections"):
        b.connect().close()
    assert b.admin("ENABLE app")[2] == "ENABLE"
    b.connect().close()


def test_kill_client_and_reconnect(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    with b.connect() as conn:
        conn.execute("select 1")
        columns, rows, _ = b.admin("SHOW CLIENTS")
        names = [c for c, _ in columns]
        app_ids = [r[names.index("id")] for r in rows if r[names.index("database")] == "app"]
        assert b.admin("RECONNECT app")[2] == "RECONNECT"
        assert b.admin("WAIT_CLOSE app")[2] == "WAIT_CLOSE"
        assert b.admin(f"KILL_CLIENT {app_ids[0]}")[2] == "KILL_CLIENT"
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
    assert b.admin("KILL_CLIENT 987654")[1:] == ("08P01", "client not found")
    for odd in ('"²"', '"c²"', "x"):  # (not an id: an error, not a dropped session)
        assert b.admin(f"KILL_CLIENT {odd}")[1] == "08P01", odd
    # A max_packet_size no socket buffer could take is refused, not a proxy
    # that turns every new connection away.
    assert b.admin("SET max_packet_size = 99999999999999999999")[0] == "error"
    with b.connect() as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_unix_socket_console_as_own_user(scry_bouncer: Bouncer) -> None:
    """The OS user running scry logs in as ``pgbouncer`` over the socket, no password."""
    b = scry_bouncer
    with psycopg.connect(
        host=str(b.dir), port=b.port, user="pgbouncer", dbname="pgbouncer", autocommit=True
    ) as conn:
        conn.prepare_threshold = None
        cur = conn.execute("SHOW VERSION", prepare=False)
        assert cur.fetchone()[0].startswith("PgBouncer 1.25")
        assert conn.execute("RELOAD", prepare=False).statusmessage == "RELOAD"


def test_reload_rereads_the_ini(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    b.write_ini("default_pool_size = 7\n")  # a repeated key: the last one wins
    assert b.proc is not None
    b.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while True:
        sizes = {r[0]: r[5] for r in b.admin("SHOW DATABASES")[1]}
        if sizes["app"] == 7:
            break
        assert time.monotonic() < deadline, sizes
        time.sleep(0.05)
    assert b.admin("SET default_pool_size = 9")[2] == "SET default_pool_size=9"
    assert {r[0]: r[5] for r in b.admin("SHOW DATABASES")[1]}["app"] == 9


def test_pidfile_and_stats(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    pidfile = b.dir / "scry.pid"
    assert b.proc is not None and pidfile.read_text().strip() == str(b.proc.pid)
    with b.connect() as conn:
        for _ in range(5):
            conn.execute("select 1")
    deadline = time.monotonic() + 5
    while True:
        columns, rows, _ = b.admin("SHOW STATS")
        names = [c for c, _ in columns]
        app = next(r for r in rows if r[0] == "app")
        if app[names.index("total_query_count")] >= 5:
            break
        assert time.monotonic() < deadline, app
        time.sleep(0.1)
    b.stop()
    assert not pidfile.exists()


# --- auth_type = hba -----------------------------------------------------------------

HBA = """\
# the same rules for both poolers
local     all        all      peer
host      all        blocked  127.0.0.1/32  reject
host      app        app      127.0.0.1/32  md5
host      pgbouncer  admin    127.0.0.1/32  md5
"""
HBA_LOGINS = [  # (over the socket?, user, password, database)
    (False, "app", "app_pass", "app"),
    (False, "app", "wrong", "app"),
    (False, "blocked", "blocked_pass", "app"),
    (False, "admin", "admin_pass", "pgbouncer"),
    (False, "stats", "stats_pass", "pgbouncer"),  # no rule
    (False, "app", "app_pass", "forced"),  # no rule for this database
    (True, "app", "app_pass", "app"),  # peer: the OS user is not app
]


def _login(b: Bouncer, local: bool, user: str, password: str, dbname: str) -> str:
    host = str(b.dir) if local else "127.0.0.1"
    try:
        with psycopg.connect(host=host, port=b.port, user=user, password=password,
                             dbname=dbname, sslmode="disable", connect_timeout=10,
                             autocommit=True) as conn:  # fmt: skip
            conn.execute("SHOW VERSION" if dbname == "pgbouncer" else "select 1", prepare=False)
        return "in"
    except psycopg.OperationalError:
        return "refused"


def test_hba_file_lets_in_whom_pgbouncer_lets_in(pg: DevCluster, workdir: Path) -> None:
    """The same ini (auth_type = hba) and pg_hba-format file: the same logins succeed."""
    (workdir / "hba.conf").write_text(HBA)
    _chown(workdir / "hba.conf")
    with open(workdir / "userlist.txt", "a") as userlist:
        userlist.write('"blocked" "blocked_pass"\n')
    outcomes = {}
    for kind in ("pgbouncer", "scry"):
        bouncer = Bouncer(kind, pg, workdir)
        bouncer.write_ini(f"auth_hba_file = {workdir}/hba.conf\n")
        bouncer.ini.write_text(
            bouncer.ini.read_text().replace("auth_type = md5", "auth_type = hba")
        )
        bouncer.start()
        try:
            outcomes[kind] = [_login(bouncer, *login) for login in HBA_LOGINS]
        finally:
            bouncer.stop()
    assert outcomes["scry"] == outcomes["pgbouncer"], outcomes
    assert outcomes["scry"] == ["in", "refused", "refused", "in", "refused", "refused", "refused"]


def test_a_peer_rule_with_a_user_name_map(pg: DevCluster, workdir: Path, wait_until) -> None:
    """auth_ident_file (PgBouncer 1.23's; 1.18 has none, so scry alone): a
    peer rule's map= lets the OS user in as the database users its map names,
    and a reload (SIGHUP) reads the maps again."""
    os_user = pwd.getpwuid(os.getuid()).pw_name
    (workdir / "hba.conf").write_text("local all all peer map=local\n")
    (workdir / "ident.conf").write_text(f"local {os_user} app\n")
    bouncer = Bouncer("scry", pg, workdir)
    bouncer.write_ini(
        f"auth_hba_file = {workdir}/hba.conf\nauth_ident_file = {workdir}/ident.conf\n"
    )
    bouncer.ini.write_text(bouncer.ini.read_text().replace("auth_type = md5", "auth_type = hba"))
    bouncer.start()
    try:
        assert _login(bouncer, True, "app", "", "app") == "in"
        assert _login(bouncer, True, "stats", "", "pgbouncer") == "refused"
        assert "not in map local as stats" in bouncer.output()
        (workdir / "ident.conf").write_text(f"local {os_user} all\n")
        assert bouncer.proc is not None
        bouncer.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _login(bouncer, True, "stats", "", "pgbouncer") == "in", 10,
                   what="the reloaded map to let stats in")  # fmt: skip
        assert _login(bouncer, True, "app", "", "app") == "in"
    finally:
        bouncer.stop()


AUTH_QUERY_LOGINS = [  # (local, user, password, dbname)
    (False, "md5_user", "md5_pass", "app"),  # md5 secret: client and server login
    (False, "md5_user", "wrong", "app"),
    (False, "scram_user", "scram_pass", "forced"),  # SCRAM secret, forced server user
    (False, "scram_user", "wrong", "forced"),
    (False, "nobody", "md5_pass", "app"),
    (False, "scram_user", "scram_pass", "app"),  # SCRAM pass-through
]


def test_auth_query_lets_in_whom_pgbouncer_lets_in(pg: DevCluster, workdir: Path) -> None:
    """The same ini with auth_user / auth_query: the same logins succeed, but one."""
    outcomes = {}
    for kind in ("pgbouncer", "scry"):
        bouncer = Bouncer(kind, pg, workdir)
        bouncer.write_ini(
            "auth_user = postgres\n"
            "auth_query = SELECT usename, passwd FROM pg_shadow WHERE usename=$1\n"
        )
        bouncer.start()
        try:
            outcomes[kind] = [_login(bouncer, *login) for login in AUTH_QUERY_LOGINS]
        finally:
            bouncer.stop()
    assert outcomes["scry"] == ["in", "refused", "in", "refused", "refused", "in"], outcomes
    same = [0, 1, 3, 4, 5]
    assert [outcomes["pgbouncer"][i] for i in same] == [outcomes["scry"][i] for i in same]
    # A known difference (docs/migrating-from-pgbouncer.md): with a forced user
    # PgBouncer 1.18 logs in with the client's SCRAM keys instead of the forced
    # user's password, and fails (pgbouncer/pgbouncer#1072).


def _fast_close_script(bouncer: Bouncer) -> list[str]:
    """Session pooling with server_fast_close = 1: what RECONNECT does to an
    idle session and to one inside a transaction."""

    def attempt(conn: psycopg.Connection, sql: str) -> str:
        try:
            conn.execute(sql)
            return "ok"
        except psycopg.OperationalError:
            return "closed"

    def app_servers() -> int:
        columns, rows, _ = bouncer.admin("SHOW SERVERS")
        database = [name for name, _ in columns].index("database")
        return sum(1 for row in rows if row[database] == "app")

    idle = bouncer.connect()
    idle.execute("select 1")
    busy = bouncer.connect()
    busy.autocommit = False
    busy.execute("select 1")  # (a transaction is open)
    assert bouncer.admin("RECONNECT app")[2] == "RECONNECT"
    seen = [attempt(busy, "select 2")]  # the transaction is not cut short
    busy.commit()
    deadline = time.monotonic() + 5  # (PgBouncer acts in its janitor, scry at once)
    while app_servers() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen += [f"servers left: {app_servers()}", attempt(busy, "select 3"), attempt(idle, "select 4")]
    idle.close()
    busy.close()
    return seen


def test_server_fast_close_ends_sessions_as_pgbouncer_does(pg: DevCluster, workdir: Path) -> None:
    outcomes = {}
    for kind in ("pgbouncer", "scry"):
        with running(kind, pg, workdir, "pool_mode = session\nserver_fast_close = 1\n") as b:
            outcomes[kind] = _fast_close_script(b)
    assert outcomes["scry"] == outcomes["pgbouncer"], outcomes
    assert outcomes["scry"] == ["ok", "servers left: 0", "closed", "closed"]


async def _startup_parameters_script(bouncer: Bouncer) -> list[str]:
    dsn = f"postgresql://app:app_pass@127.0.0.1:{bouncer.port}/app?sslmode=disable"
    listed = {"connect_timeout": "10", "TimeZone": "Asia/Tokyo"}
    conn = await asyncpg.connect(dsn, server_settings=listed, timeout=10)
    try:
        seen = [await conn.fetchval("select current_setting('TimeZone')")]
    finally:
        await conn.close()
    try:
        await asyncpg.connect(dsn, server_settings={"not_listed": "1"}, timeout=10)
        seen.append("connected")
    except asyncpg.PostgresError:
        seen.append("refused")  # (PgBouncer: 08P01; scry: 42704, as PostgreSQL says)
    return seen


async def test_ignore_startup_parameters_lets_in_whom_pgbouncer_lets_in(
    pg: DevCluster, workdir: Path
) -> None:
    outcomes = {}
    for kind in ("pgbouncer", "scry"):
        with running(kind, pg, workdir, "ignore_startup_parameters = connect_timeout\n") as b:
            outcomes[kind] = await _startup_parameters_script(b)
    assert outcomes["scry"] == outcomes["pgbouncer"] == ["Asia/Tokyo", "refused"], outcomes


async def _options_script(bouncer: Bouncer) -> list[str]:
    """What comes of each options string: the TimeZone a client ends up with,
    or "refused"."""
    dsn = f"postgresql://app:app_pass@127.0.0.1:{bouncer.port}/app?sslmode=disable"
    seen = []
    for options in (
        "-c TimeZone=Asia/Tokyo",
        "-c no_such_setting=1",  # (PostgreSQL: 42704)
        "-c statement_timeout=soon -c TimeZone=Asia/Tokyo",  # (22023, and one it accepts)
        "endpoint=ep-quiet-1",  # (a cloud router's; malformed for PostgreSQL)
    ):
        try:
            conn = await asyncpg.connect(dsn, server_settings={"options": options}, timeout=10)
        except asyncpg.PostgresError:
            seen.append("refused")
            continue
        try:
            seen.append(await conn.fetchval("select current_setting('TimeZone')"))
        finally:
            await conn.close()
    return seen


async def test_ignored_options_never_refuse_a_client(pg: DevCluster, workdir: Path) -> None:
    """PgBouncer drops a listed ``options`` whole. scry lets in the same
    clients, and applies each setting in it that PostgreSQL accepts."""
    outcomes = {}
    for kind in ("pgbouncer", "scry"):
        with running(kind, pg, workdir, "ignore_startup_parameters = options\n") as b:
            outcomes[kind] = await _options_script(b)
    default = pg.psql("show TimeZone").strip()
    assert default != "Asia/Tokyo"
    assert outcomes["pgbouncer"] == [default] * 4, outcomes
    assert outcomes["scry"] == ["Asia/Tokyo", default, "Asia/Tokyo", default], outcomes
