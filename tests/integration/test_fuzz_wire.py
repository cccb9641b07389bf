"""A wire fuzzer against a running proxy.

Many clients, for a bounded time, send random and mutated-valid protocol
traffic (startup packets, simple and extended queries, pipelines, COPY,
cancel requests, garbage, truncated and corrupted messages, abrupt
disconnects) to three databases of one proxy, one per pool mode. Afterwards
the proxy must still serve a normal client, hold no more server connections
than its pools allow, all of them idle, and have logged no Python traceback.

The seed is printed; ``SCRY_FUZZ_SEED=<n>`` replays a run (as far as thread
timing allows) and ``SCRY_FUZZ_SECONDS`` changes its length.
"""

from __future__ import annotations

import os
import random
import re
import socket
import struct
import threading
import time

import httpx
import psycopg
import pytest

from scry.devcluster import free_port

PROTOCOL_3 = 196608
POOL_SIZE = 2
DATABASES = {"fz_tx": "transaction", "fz_session": "session", "fz_hybrid": "hybrid"}
SECONDS = float(os.environ.get("SCRY_FUZZ_SECONDS", "15"))
N_CLIENTS = 12


# --- message builders ---------------------------------------------------------------------


def msg(kind: bytes, body: bytes = b"") -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def startup(user: str, database: str, extra: dict[str, str] | None = None) -> bytes:
    body = struct.pack("!i", PROTOCOL_3) + cstr("user") + cstr(user)
    body += cstr("database") + cstr(database)
    for k, v in (extra or {}).items():
        body += cstr(k) + cstr(v)
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


def q(sql: str) -> bytes:
    return msg(b"Q", cstr(sql))


def parse(sql: str, name: str = "") -> bytes:
    return msg(b"P", cstr(name) + cstr(sql) + struct.pack("!h", 0))


def bind(params: tuple[str, ...] = (), stmt: str = "", portal: str = "") -> bytes:
    body = cstr(portal) + cstr(stmt) + struct.pack("!hh", 0, len(params))
    for p in params:
        body += struct.pack("!i", len(p.encode())) + p.encode()
    return msg(b"B", body + struct.pack("!h", 0))


def execute(portal: str = "", rows: int = 0) -> bytes:
    return msg(b"E", cstr(portal) + struct.pack("!i", rows))


def describe(kind: bytes, name: str = "") -> bytes:
    return msg(b"D", kind + cstr(name))


SYNC, FLUSH, TERMINATE, COPY_DONE = msg(b"S"), msg(b"H"), msg(b"X"), msg(b"c")

QUERIES = [
    "select 1",
    "select pg_sleep(0.05)",
    "begin",
    "commit",
    "rollback",
    "select repeat('x', 20000)",
    "select g, md5(g::text) from generate_series(1, 300) g",
    "set application_name = 'fuzz'",
    "set statement_timeout = '2s'",
    "select 1/0",
    "select * from no_such_table",
    "listen fuzz_channel",
    "notify fuzz_channel, 'hi'",
    "prepare fz_p as select $1::int",
    "execute fz_p(1)",
    "deallocate all",
    "do $$ begin raise notice 'fuzz notice'; end $$",
    "select pg_advisory_xact_lock(42)",
    "create temp table if not exists fz_tmp (x int)",
    "copy (select g from generate_series(1, 500) g) to stdout",
    "",
    ";;;",
    "select 1; select 2; select 1/0; select 3",
]


def extended(rng: random.Random) -> bytes:
    sql = rng.choice(["select $1::int", "select $1::text || 'x'", "select 1/$1::int"])
    name = rng.choice(["", "", "fz_s1", "fz_s2"])
    out = parse(sql, name) + bind((str(rng.randint(0, 3)),), stmt=name)
    if rng.random() < 0.5:
        out += describe(b"P")
    out += execute(rows=rng.choice([0, 0, 1]))
    if rng.random() < 0.2:
        out += msg(b"C", b"S" + cstr(name))  # Close statement
    return out + rng.choice([SYNC, SYNC, SYNC, FLUSH, FLUSH + SYNC, b""])


def copy_in(rng: random.Random) -> bytes:
    out = q(rng.choice(["copy fz_copy from stdin", "copy fz_copy (x) from stdin (format binary)"]))
    for _ in range(rng.randint(0, 5)):
        out += msg(b"d", rng.choice([b"1\n", b"2\n3\n", b"x\n", os.urandom(rng.randint(0, 30))]))
    return out + rng.choice([COPY_DONE, msg(b"f", cstr("fuzz")), b"", SYNC, q("select 1")])


def mutate(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return os.urandom(rng.randint(1, 20))
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)  # bit flip
        elif op == 1 and b:
            b[i] = rng.randrange(256)  # byte
        elif op == 2:
            b = b[: rng.randrange(len(b) + 1)]  # truncate
        elif op == 3 and len(b) >= 5:
            start = rng.randrange(0, max(1, len(b) - 4))
            b[start + 1 : start + 5] = struct.pack(
                "!i", rng.choice([0, 3, 4, 5, 2**31 - 1, -1, 70000])
            )
        elif op == 4:
            b[i:i] = os.urandom(rng.randint(1, 8))  # insert
        elif op == 5 and b:
            b[0] = rng.choice(b"QPBEDSHXCdcfFpZ?\x00\xff")  # another message type
        else:
            b = b + b  # duplicate
        if not b:
            b = bytearray(os.urandom(1))
    return bytes(b)


# --- the fuzz client --------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.logins = 0
        self.actions = 0
        self.closed_by_proxy = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def drain(sock: socket.socket, seconds: float) -> bytes | None:
    """What arrives within ``seconds``; None when the proxy closed the connection."""
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
            if data.endswith(b"Z\x00\x00\x00\x05I") or len(data) > 1 << 20:
                return data
    except (TimeoutError, BlockingIOError):  # (a 0 s timeout makes the socket non-blocking)
        return data
    except OSError:
        return None


def login(sock: socket.socket, database: str) -> tuple[int, int] | None:
    sock.sendall(startup("app", database))
    sock.settimeout(8)
    data = b""
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
        pos, key = 0, None
        while pos + 5 <= len(data):
            (length,) = struct.unpack_from("!i", data, pos + 1)
            if pos + 1 + length > len(data):
                break
            kind = data[pos : pos + 1]
            if kind == b"E":
                return None
            if kind == b"K":
                key = struct.unpack_from("!iI", data, pos + 5)
            if kind == b"Z":
                return key or (0, 0)
            pos += 1 + length
    return None


def send_cancel(port: int, key: tuple[int, int]) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(struct.pack("!iiiI", 16, 80877102, *key))
            s.recv(16)
    except OSError:
        pass


def fuzz_client(port: int, seed: int, deadline: float, stats: Stats) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        database = rng.choice(list(DATABASES))
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            roll = rng.random()
            if roll < 0.06:
                # A broken startup phase.
                sock.sendall(mutate(rng, startup("app", database)))
                drain(sock, 0.3)
                continue
            if roll < 0.09:
                sock.sendall(struct.pack("!ii", 8, rng.choice([80877103, 80877104])))
                drain(sock, 0.1)
            key = login(sock, database)
            if key is None:
                continue
            stats.add(logins=1)
            for _ in range(rng.randint(1, 12)):
                if time.monotonic() > deadline:
                    break
                action = rng.random()
                if action < 0.30:
                    data = q(rng.choice(QUERIES))
                elif action < 0.50:
                    data = b"".join(extended(rng) for _ in range(rng.randint(1, 6)))
                elif action < 0.58:
                    data = copy_in(rng)
                elif action < 0.82:
                    base = rng.choice([q(rng.choice(QUERIES)), extended(rng), copy_in(rng)])
                    data = mutate(rng, base)
                elif action < 0.88:
                    data = os.urandom(rng.randint(1, 200))
                elif action < 0.93:
                    threading.Thread(target=send_cancel, args=(port, key), daemon=True).start()
                    data = q("select pg_sleep(0.2)")
                else:
                    data = SYNC * rng.randint(1, 5)
                try:
                    if rng.random() < 0.3 and len(data) > 2:
                        cut = rng.randrange(1, len(data))
                        sock.sendall(data[:cut])
                        time.sleep(rng.choice([0, 0.001, 0.02]))
                        sock.sendall(data[cut:])
                    else:
                        sock.sendall(data)
                except OSError:
                    stats.add(closed_by_proxy=1)
                    break
                stats.add(actions=1)
                if drain(sock, rng.choice([0.0, 0.05, 0.2])) is None:
                    stats.add(closed_by_proxy=1)
                    break
            ending = rng.random()
            if ending < 0.4:
                try:
                    sock.sendall(TERMINATE)
                except OSError:
                    pass
            elif ending < 0.7:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            sock.close()


def proxy_state(admin_port: int) -> str:
    """The admin API's view of pools, clients and servers, for a failure message."""
    out = []
    for what in ("pools", "clients", "servers", "breaker"):
        try:
            body = httpx.get(f"http://127.0.0.1:{admin_port}/api/v1/{what}", timeout=5).text
        except httpx.HTTPError as exc:
            body = f"({exc})"
        out.append(f"--- {what}: {body}\n")
    return "".join(out)


# --- the test -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wire_fuzz_many_clients(scry_proxy, pg) -> None:
    with psycopg.connect(pg.dsn(user="app", sslmode="disable"), autocommit=True) as conn:
        conn.execute("drop table if exists fz_copy")
        conn.execute("create table fz_copy (x int)")
    url = pg.url(options="-c statement_timeout=3000")  # caps what a mutated query can cost
    admin_port = free_port()  # the admin API, for a state dump when something is stuck
    proxy = scry_proxy(
        {
            "database_url": None,
            "databases": {
                name: {"database_url": url, "pool": {"mode": mode, "size": POOL_SIZE}}
                for name, mode in DATABASES.items()
            },
            "auth": {"type": "trust"},
            "max_packet_size": 65536,
            "timeouts": {"client_login_timeout": 3, "query_wait_timeout": 4},
            "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}"},
        }
    )
    seed = int(os.environ.get("SCRY_FUZZ_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed}")
    stats = Stats()
    deadline = time.monotonic() + SECONDS
    threads = [
        threading.Thread(target=fuzz_client, args=(proxy.port, seed + i, deadline, stats))
        for i in range(N_CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 30)
    assert not any(t.is_alive() for t in threads), "a fuzz client hung"
    print(f"fuzz: {stats.logins} logins, {stats.actions} actions, "
          f"{stats.closed_by_proxy} closed by the proxy")  # fmt: skip
    assert stats.logins > 50 and stats.actions > 200, "the fuzzer barely ran"
    assert proxy.returncode is None, proxy.log_tail()

    # A normal client of every database is served (in a thread: a stuck one must
    # fail with the proxy's state, not hang until the test's timeout).
    for name in DATABASES:
        answer: list[object] = []

        def alive(name: str = name, answer: list[object] = answer) -> None:
            try:
                with psycopg.connect(
                    **{**proxy.conninfo(), "dbname": name}, autocommit=True
                ) as conn:
                    answer.append(conn.execute("select 'alive'").fetchone())
            except Exception as exc:
                answer.append(exc)

        checker = threading.Thread(target=alive, daemon=True)
        checker.start()
        checker.join(20)
        if answer != [("alive",)]:
            pytest.fail(
                f"seed {seed}: a normal client of {name} got {answer or 'no answer in 20 s'}\n"
                + proxy_state(admin_port)
                + proxy.log_tail(80)
            )

    # No leaked server: at most the pools' sizes, all idle.
    pids = [int(p) for p in re.findall(r"server connected .*?backend_pid=(\d+)", proxy.log_text())]
    limit = POOL_SIZE * len(DATABASES)
    # Everything the fuzz can leave running is bounded: statement_timeout 3 s, scry's
    # own reset/check queries 2 s, query_wait_timeout 4 s, all enforced on a 1 s tick.
    # 20 s leaves room for a loaded 2-core CI machine without hiding a leak.
    deadline = time.monotonic() + 20
    while True:
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as conn:
            rows = conn.execute(
                "select pid, state, query from pg_stat_activity where pid = any(%s)", (pids,)
            ).fetchall()
        if len(rows) <= limit and all(r[1] == "idle" for r in rows):
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"seed {seed}: after the fuzz, {len(rows)} backends (limit {limit}): {rows}\n"
                + proxy.log_tail(60)
            )
        time.sleep(0.1)
    log = proxy.log_text()
    assert "Traceback" not in log, proxy.log_tail(80)
