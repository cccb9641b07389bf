"""The console of scry-pgbouncer alone: every SHOW answers, every command works.

Differential checks against PgBouncer are in test_pgbouncer_compat.py; this
module covers the views and commands those do not reach, so that a change in
the console's modules cannot break one unnoticed.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from test_pgbouncer_compat import Bouncer, bouncer_dir, running

from scry.devcluster import DevCluster

# Every view, with its expected columns (PgBouncer 1.25's, or scry's own).
VIEW_COLUMNS = {
    "SHOW ACTIVE_SOCKETS": 28,
    "SHOW PEERS": 4,
    "SHOW PEER_POOLS": 5,
    "SHOW MEM": 5,
    "SHOW DNS_HOSTS": 3,
    "SHOW DNS_ZONES": 3,
    "SHOW STATE": 2,
    "SHOW PINS": 7,
    "SHOW BREAKER": 4,
    "SHOW FINGERPRINTS": 7,
    "SHOW SOCKETS": 28,
    "SHOW STATS_AVERAGES": 12,
    "SHOW client_encoding": 1,
}


@pytest.fixture
def scry_bouncer(pg: DevCluster) -> Iterator[Bouncer]:
    with bouncer_dir() as directory, running("scry", pg, directory) as bouncer:
        yield bouncer


def test_every_view_answers(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    with b.connect() as conn:
        conn.execute("select 1")
        for sql, width in VIEW_COLUMNS.items():
            answer = b.admin(sql)
            assert answer[0] != "error", (sql, answer)
            assert len(answer[0]) == width, (sql, answer[0])
        breaker = {r[0]: r[1] for r in b.admin("SHOW BREAKER")[1]}
        assert breaker["app"] == "closed"
    assert b.admin("SHOW FDS")[0] == "error"
    assert b.admin("SHOW FDS", "stats", "stats_pass")[1:] == ("08P01", "admin access needed")
    # PgBouncer's answer quotes a statement it does not know; its log line does not.
    refused = b.admin("SELECT 'canary-c41d' FROM users")
    assert refused[0] == "error" and "canary-c41d" in refused[2]
    assert "invalid command 'SELECT ...'" in b.output() and "canary-c41d" not in b.output()
    with psycopg.connect(
        host="127.0.0.1", port=b.port, user="admin", password="admin_pass", dbname="pgbouncer",
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.prepare_threshold = None
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_detail or ""))
        conn.execute("SHOW HELP", prepare=False)
        assert "KILL_CLIENT" in notices[0] and "SHOW PINS" in notices[0]
        assert conn.execute("SET client_encoding = 'UTF8'", prepare=False).statusmessage == "SET"


def test_a_set_that_cannot_be_applied_fails_and_is_forgotten(scry_bouncer: Bouncer) -> None:
    """An auth_file that cannot be read: SET fails (nothing changed), and the
    next SET and RELOAD apply as if it had never been said."""
    b = scry_bouncer
    assert b.admin("SET auth_file = '/nonexistent/userlist.txt'")[1:] == ("08P01", "SET failed")
    assert b.admin("SET default_pool_size = 9")[2] == "SET default_pool_size=9"
    assert b.admin("RELOAD")[2] == "RELOAD"
    columns, rows, _ = b.admin("SHOW DATABASES")
    names = [name for name, _type in columns]
    app = next(row for row in rows if row[names.index("name")] == "app")
    assert app[names.index("pool_size")] == 9


def test_suspend_resume(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    with b.connect() as conn:
        conn.execute("select 1")
        assert b.admin("SUSPEND")[2] == "SUSPEND"
        assert dict(b.admin("SHOW STATE")[1])["suspended"] == "yes"
        assert b.admin("SUSPEND")[1:] == ("08P01", "already suspended/paused")
        assert b.admin("RESUME")[2] == "RESUME"
        assert conn.execute("select 2").fetchone() == (2,)


def test_sigusr1_pauses_and_sigusr2_resumes_from_pause_or_suspend(
    scry_bouncer: Bouncer, wait_until
) -> None:
    b = scry_bouncer
    assert b.proc is not None

    def state(key: str) -> str:
        return dict(b.admin("SHOW STATE")[1])[key]

    b.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: state("paused") == "yes", 10, what="SIGUSR1 to pause")
    b.proc.send_signal(signal.SIGUSR2)
    wait_until(lambda: state("paused") == "no", 10, what="SIGUSR2 to resume")
    assert b.admin("SUSPEND")[2] == "SUSPEND"
    b.proc.send_signal(signal.SIGUSR2)
    wait_until(lambda: state("suspended") == "no", 10, what="SIGUSR2 to end SUSPEND")
    with b.connect(dbname="forced") as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_log_connections_and_log_disconnections_turn_each_kind_off(
    pg: DevCluster, wait_until
) -> None:
    """log_connections = 0 drops the login lines (clients' and servers'),
    log_disconnections = 0 the close lines; SET turns one back on alone.
    Errors that close a client are still logged (log_pooler_errors)."""
    extra = "log_connections = 0\nlog_disconnections = 0\n"
    with bouncer_dir() as directory, running("scry", pg, directory, extra) as b:

        def app_clients() -> int:
            return sum(row[1] == "app" for row in b.admin("SHOW CLIENTS")[1])

        for query in ("select 1", "select 2"):
            with b.connect() as conn:
                conn.execute(query)
            wait_until(lambda: app_clients() == 0, 10, what="the client's close")
            if query == "select 1":
                assert b.admin("SET log_connections = 1")[2].startswith("SET")
        with pytest.raises(psycopg.OperationalError):
            b.connect(dbname="nosuch")
        # log_pooler_errors (on): the error that closed a client is still logged.
        error = 'error="no such database: nosuch"'
        wait_until(lambda: error in b.output(), 10, what="the pooler error's line")
        log = b.output()
        assert log.count("client login") == 1, log  # the second client's only
        assert "server connected" not in log and "client closed" not in log, log


def test_syslog_set_on_gets_every_line_with_pgbouncers_ident(pg: DevCluster) -> None:
    """SET syslog = 1 (a reload) sends the log lines to syslog too (here a
    socket of the test's, set with the [scry] section's log.syslog_address),
    tagged with PgBouncer's default ident and the ini's facility."""
    with bouncer_dir() as directory, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as syslog:
        address = directory / "syslog.sock"
        syslog.bind(str(address))
        syslog.settimeout(10)
        b = Bouncer("scry", pg, directory)
        b.write_ini("syslog_facility = local3\n")
        b.ini.write_text(b.ini.read_text() + f"[scry]\nlog.syslog_address = {address}\n")
        b.start()
        try:
            with b.connect() as conn:  # (not sent: syslog is off)
                conn.execute("select 1")
            assert b.admin("SET syslog = 1")[2].startswith("SET")
            with b.connect() as conn:
                conn.execute("select 2")
            line = b""
            while b"client login" not in line:  # (after the reload's lines)
                line = syslog.recv(4096)
            local3_info = 19 * 8 + 6
            assert line.startswith(b"<%d>pgbouncer[%d]: info client login " % (
                local3_info, b.proc.pid if b.proc else 0,
            )), line  # fmt: skip
            assert b.output().count("client login") == 2  # stderr has both
        finally:
            b.stop()


def _md5_login(port: int, user: str, password: str, database: str) -> socket.socket:
    """A raw md5 login with a small receive buffer: a client that can stop reading."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(15)
    sock.connect(("127.0.0.1", port))
    body = struct.pack("!i", 196608) + b"user\0%s\0database\0%s\0\0" % (
        user.encode(),
        database.encode(),
    )
    sock.sendall(struct.pack("!i", len(body) + 4) + body)
    reply = sock.recv(64)
    assert reply[:1] == b"R" and struct.unpack("!i", reply[5:9])[0] == 5, reply  # md5
    inner = hashlib.md5((password + user).encode()).hexdigest().encode()
    digest = b"md5" + hashlib.md5(inner + reply[9:13]).hexdigest().encode() + b"\0"
    sock.sendall(b"p" + struct.pack("!i", len(digest) + 4) + digest)
    seen = b""
    while not seen.endswith(b"Z\0\0\0\x05I"):
        seen += sock.recv(4096)
    return sock


def test_suspend_timeout_closes_a_client_that_does_not_read(pg: DevCluster, wait_until) -> None:
    """SUSPEND waits for what scry still has to send; a client that reads
    nothing is closed after suspend_timeout, and the others carry on."""
    with bouncer_dir() as directory, running(
        "scry", pg, directory, "suspend_timeout = 1\n"
    ) as b:  # fmt: skip
        other = b.connect()
        other.execute("select 1")
        stuck = _md5_login(b.port, "app", "app_pass", "app")
        query = b"select repeat('x', 100000) from generate_series(1, 2000)\0"
        stuck.sendall(b"Q" + struct.pack("!i", len(query) + 4) + query)  # 200 MB, never read

        def unsent_to_clients() -> int:
            columns, rows, _ = b.admin("SHOW SOCKETS")
            names = [name for name, _ in columns]
            kind, unsent = names.index("type"), names.index("send_avail")
            return sum(row[unsent] for row in rows if row[kind] == "C")

        wait_until(unsent_to_clients, 10, what="scry to hold data for the stuck client")
        with b.connect("admin", "admin_pass", "pgbouncer") as admin:
            admin.prepare_threshold = None
            started = time.monotonic()
            assert admin.execute("SUSPEND", prepare=False).statusmessage == "SUSPEND"
            assert time.monotonic() - started >= 1.0  # it waited for the stuck client
            with pytest.raises((ConnectionResetError, EOFError)):
                while stuck.recv(1 << 20):  # what the kernel holds, then the close
                    pass
                raise EOFError
            assert admin.execute("RESUME", prepare=False).statusmessage == "RESUME"
        assert other.execute("select 2").fetchone() == (2,)
        stuck.close()
        other.close()
        assert "suspend_timeout: closing a connection with unsent data" in b.output()


def test_a_login_held_by_suspend_is_not_timed_out_meanwhile(pg: DevCluster) -> None:
    """PgBouncer leaves a client that connects during SUSPEND in the listen
    backlog, with no client_login_timeout running: scry holds its login
    instead, and times it from RESUME."""
    with bouncer_dir() as directory, running(
        "scry", pg, directory, "client_login_timeout = 1\n"
    ) as b:  # fmt: skip
        with b.connect("admin", "admin_pass", "pgbouncer") as admin:
            admin.prepare_threshold = None
            assert admin.execute("SUSPEND", prepare=False).statusmessage == "SUSPEND"
            answer: list[object] = []

            def new_client() -> None:
                try:
                    with b.connect() as conn:
                        answer.append(conn.execute("select 5").fetchone())
                except psycopg.Error as exc:
                    answer.append(exc)

            thread = threading.Thread(target=new_client)
            thread.start()
            # Two janitor passes or more beyond the timeout (nothing to await:
            # what must not happen is the close).
            thread.join(3.0)
            assert thread.is_alive() and not answer, answer
            assert admin.execute("RESUME", prepare=False).statusmessage == "RESUME"
            thread.join(10)
        assert answer == [(5,)], answer
        assert "client_login_timeout" not in b.output()


def test_kill_database_then_resume(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    conn = b.connect()
    conn.execute("select 1")
    assert b.admin("KILL nosuch")[1:] == ("08P01", "no such database: nosuch")
    assert b.admin("KILL app")[2] == "KILL"
    with pytest.raises(psycopg.OperationalError):
        conn.execute("select 1")
    conn.close()
    states = {r[0]: r[-2] for r in b.admin("SHOW DATABASES")[1]}
    assert states["app"] == 1
    assert b.admin("RESUME app")[2] == "RESUME"
    with b.connect() as again:
        assert again.execute("select 3").fetchone() == (3,)


def test_shutdown_wait_for_clients(scry_bouncer: Bouncer) -> None:
    b = scry_bouncer
    conn = b.connect()
    conn.execute("select 1")
    assert b.admin("SHUTDOWN WAIT_FOR_CLIENTS")[2] == "SHUTDOWN"
    assert conn.execute("select 4").fetchone() == (4,)  # existing clients go on
    assert b.proc is not None and b.proc.poll() is None
    conn.close()
    assert b.proc.wait(10) == 0


def test_autodb_databases_are_freed_when_idle(pg: DevCluster, wait_until) -> None:
    """autodb_idle_timeout: a database made from '*' (one that exists, and one
    that does not) is forgotten once no client and no server has used it."""
    with bouncer_dir() as directory:
        b = Bouncer("scry", pg, directory)
        b.write_ini("autodb_idle_timeout = 1\nserver_idle_timeout = 1\n")
        b.ini.write_text(
            b.ini.read_text().replace(
                "[databases]\n", f"[databases]\n* = port={pg.port} host=127.0.0.1\n"
            )
        )
        b.start()
        try:

            def databases() -> set[str]:
                return {row[0] for row in b.admin("SHOW DATABASES")[1]}

            with b.connect(dbname="postgres") as conn:
                assert conn.execute("select current_database()").fetchone() == ("postgres",)
            with pytest.raises(psycopg.OperationalError, match="does not exist"):
                b.connect(dbname="made_up")
            assert {"postgres", "made_up"} <= databases()
            # The idle server closes first (server_idle_timeout), then the database goes.
            wait_until(lambda: not {"postgres", "made_up"} & databases(), 10, what="freed")
            assert (
                "autodb freed" in b.output()
                or "autodb freed" in (directory / "scry.log").read_text()
            )
            with b.connect(dbname="postgres") as conn:  # asked for again: made again
                assert conn.execute("select 1").fetchone() == (1,)
            assert "app" in databases()  # configured databases are never freed
        finally:
            b.stop()


def test_reconnect_closes_a_server_its_client_kept_between_transactions(
    scry_bouncer: Bouncer, wait_until
) -> None:
    """Transaction pooling: a server busy at RECONNECT and kept by its client
    afterwards (no one else wanted it) is closed all the same, within a
    janitor pass, and the client goes on with a new one."""
    b = scry_bouncer

    def app_servers() -> list[int]:
        columns, rows, _ = b.admin("SHOW SERVERS")
        names = [name for name, _ in columns]
        return [r[names.index("remote_pid")] for r in rows if r[names.index("database")] == "app"]

    with b.connect() as conn:
        for _ in range(2):  # (from its second transaction on, a client keeps its server)
            conn.execute("select 1")
        with conn.transaction():
            (old_pid,) = conn.execute("select pg_backend_pid()").fetchone()
            assert b.admin("RECONNECT app")[2] == "RECONNECT"
        wait_until(lambda: not app_servers(), 5, what="the kept server closed")
        (new_pid,) = conn.execute("select pg_backend_pid()").fetchone()
        assert new_pid != old_pid


@contextlib.contextmanager
def md5_user_bouncer(pg: DevCluster, users_line: str) -> Iterator[Bouncer]:
    """scry-pgbouncer with md5_user in its userlist and ``[users] md5_user = users_line``."""
    with bouncer_dir() as directory:
        with open(directory / "userlist.txt", "a") as userlist:
            userlist.write('"md5_user" "md5_pass"\n')
        bouncer = Bouncer("scry", pg, directory)
        bouncer.ini.write_text(bouncer.ini.read_text() + f"\n[users]\nmd5_user = {users_line}\n")
        bouncer.start()
        try:
            yield bouncer
        finally:
            bouncer.stop()
        assert "Traceback" not in bouncer.output()


def test_a_users_line_sets_query_wait_timeout_and_survives_a_reload(pg: DevCluster) -> None:
    """[users] md5_user = pool_size=1 query_wait_timeout=1: a second client of
    that user waits a second (not the global 120) for the one server, and
    still does after RELOAD, which once left such a pool with the database's
    settings (pool size 4) until the user's next login."""
    with md5_user_bouncer(pg, "pool_size=1 query_wait_timeout=1") as bouncer:
        holder = bouncer.connect("md5_user", "md5_pass")
        holder.autocommit = False
        holder.execute("select 1")  # the pool's only server, in a transaction
        # (Both log in before the reload: a login applies the line again.)
        waiters = [bouncer.connect("md5_user", "md5_pass") for _ in range(2)]
        for when, waiter in zip(("before", "after"), waiters, strict=True):
            started = time.monotonic()
            with pytest.raises(psycopg.OperationalError, match="query_wait_timeout"):
                waiter.execute("select 2")
            assert 0.8 <= time.monotonic() - started <= 3.5, when
            waiter.close()
            if when == "before":
                assert bouncer.admin("RELOAD")[2] == "RELOAD"
        users = {r[0]: r for r in bouncer.admin("SHOW USERS")[1]}
        assert int(users["md5_user"][1]) == 1  # pool_size
        holder.rollback()
        holder.close()


def _closed_by_idle_transaction_timeout(
    bouncer: Bouncer, held: psycopg.Connection, wait_until
) -> None:
    wait_until(lambda: "idle transaction timeout" in bouncer.output(), 6, what="the timeout")
    with pytest.raises(psycopg.Error) as caught:
        held.execute("select 2")
    assert caught.value.sqlstate == "25P03"


def test_a_forced_users_line_times_what_its_servers_run(pg: DevCluster, wait_until) -> None:
    """PgBouncer times a running transaction by its server's user: a client
    of ``forced`` (server user app) that logged in as md5_user is held to
    app's [users] line, not to md5_user's."""
    with md5_user_bouncer(pg, "idle_transaction_timeout=30") as bouncer:
        bouncer.ini.write_text(bouncer.ini.read_text() + "app = idle_transaction_timeout=1\n")
        assert bouncer.admin("RELOAD")[2] == "RELOAD"
        held = bouncer.connect("md5_user", "md5_pass", "forced")
        held.autocommit = False
        held.execute("select 1")  # (a transaction is open, and idle)
        _closed_by_idle_transaction_timeout(bouncer, held, wait_until)
        held.close()


def test_a_users_line_sets_timeouts_for_that_users_clients(pg: DevCluster, wait_until) -> None:
    """[users] md5_user = idle_transaction_timeout=1 (PgBouncer's user-level
    timeouts): its clients are held to it, app's are not (no global one)."""
    with md5_user_bouncer(pg, "idle_transaction_timeout=1") as bouncer:
        held = bouncer.connect("md5_user", "md5_pass")
        free = bouncer.connect()
        for conn in (held, free):
            conn.autocommit = False
            conn.execute("select 1")  # (a transaction is open, and idle)
        _closed_by_idle_transaction_timeout(bouncer, held, wait_until)
        assert free.execute("select 2").fetchone() == (2,)
        free.commit()
        line = next(x for x in bouncer.output().splitlines() if "idle transaction" in x)
        assert "user=md5_user" in line, line
        held.close()
        free.close()
