"""The compiled login fast path (ClientCore._startup_fast) against ClientLogin.

A login through ClientLogin leaves a LoginPlan for its exact StartupMessage;
the next client that sends the same bytes is logged in by the compiled
ClientCore from the plan. Two proxies are driven through the same random
sequence of logins (right, wrong and split md5 answers, unknown users,
several startup packets, reloads that change a password, a pool that goes
stale, max_client_conn reached, a drain): in one every chunk goes through
``data_received``, in the other straight to ``_data_received`` (the Python
login, the reference). After every login the bytes each client was sent
and the fields a login sets must be the same, but for the md5 salt and the
cancel key: those are random in both (the compiled path draws its own), so
they are checked for what they must be (the key sent is the one registered
for the client, naming this worker) and then left out.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from fake_transport import Recorder, msg, offline_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry import peering, relay_core
from scry.client import ClientConnection
from scry.config import Config
from scry.peering import RANDOM_MASK, key_owner
from scry.proxy import Proxy

pytestmark = pytest.mark.skipif(not relay_core.COMPILED, reason="the extension was not built")

PASSWORDS = {"app": "pw", "other": "secret2"}


def config(auth_type: str, passwords: dict[str, str], max_clients: int = 100) -> Config:
    return Config.model_validate(
        {
            "database_url": "postgres://app:pw@127.0.0.1:5432/app",
            "pool": {"mode": "transaction", "size": 2, "max_client_conn": max_clients},
            "auth": {
                "type": auth_type,
                "users": [{"name": u, "password": p} for u, p in passwords.items()],
            },
        }
    )


def startup(user: str, app: str = "pgbench", database: str = "app") -> bytes:
    body = struct.pack("!i", 196608)
    for key, value in (("user", user), ("database", database), ("application_name", app)):
        body += key.encode() + b"\0" + value.encode() + b"\0"
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


def md5_answer(user: str, password: str, salt: bytes) -> bytes:
    inner = hashlib.md5((password + user).encode()).hexdigest()
    digest = "md5" + hashlib.md5(inner.encode() + salt).hexdigest()
    return msg(b"p", digest.encode() + b"\0")


class Rig:
    def __init__(self, auth_type: str, max_clients: int, fast: bool) -> None:
        self.fast = fast
        self.auth_type = auth_type
        self.proxy = Proxy(config(auth_type, PASSWORDS, max_clients))
        self.clients: list[ClientConnection] = []
        self.passwords = dict(PASSWORDS)
        self._warm_pools()

    def _warm_pools(self) -> None:
        # Every pool has had its first server (a plan needs the pool's welcome).
        target = self.proxy.targets["app"]
        for user in ("app", "other", "nobody"):
            pool = self.proxy.pool_for(target, *self.proxy.auth.server_credentials(target, user))
            if pool.welcome is None:
                pool.welcome = {"server_version": "16.0", "application_name": ""}

    def sends(self, client: ClientConnection, data: bytes) -> None:
        (client.data_received if self.fast else client._data_received)(data)

    def login(self, user: str, app: str, answer: str, split: bool) -> ClientConnection:
        client = ClientConnection(self.proxy)
        client.connection_made(Recorder())
        self.clients.append(client)
        self.sends(client, startup(user, app))
        sent = bytes(client.transport.data)
        if self.auth_type == "md5" and sent[:1] == b"R" and sent[8:9] == b"\x05":
            salt = sent[9:13]
            password = "nope" if answer == "wrong" else self.passwords.get(user, "x")
            reply = md5_answer(user, password, salt)
            if answer == "last_digit_off":  # right but for its last hex digit
                reply = reply[:-2] + (b"1" if reply[-2:-1] == b"0" else b"0") + b"\0"
            elif answer == "uppercase":  # the right digest in uppercase hex
                reply = reply[:8] + reply[8:].upper()
            for piece in [reply[:7], reply[7:]] if split else [reply]:
                if client.state != "closed":
                    self.sends(client, piece)
        return client

    def reload(self, password: str) -> None:
        self.passwords["other"] = password
        self.proxy.apply_config(
            config(self.auth_type, self.passwords, self.proxy.config.pool.max_client_conn)
        )
        self._warm_pools()

    def stale_pool(self) -> None:
        for pool in self.proxy.pools.values():
            pool.stale = True
        self._warm_pools()

    def snapshot(self, client: ClientConnection) -> tuple[Any, ...]:
        pool = client.pool
        return (
            self.sent_without_random_parts(client), client.state, client.user, client.database,
            client.params, client.state == "ready" and id(client.params), client.application_name, pool.name if pool else None,
            pool.stale if pool else None, client.transaction_pooling, client.statement_pooling,
            type(client.tracker).__name__, getattr(client.tracker, "client_id", client.id) == client.id,
            getattr(client.tracker, "pinning", None),
            client.context and (client.context.client_id == client.id, client.context[1:]),
            client.cancel_key is not None and key_owner(client.cancel_key[0]),
            client._auth is None, client._reader is None, len(self.proxy.cancel_keys),
            len(self.proxy.clients),
        )  # fmt: skip

    def sent_without_random_parts(self, client: ClientConnection) -> bytes:
        """What ``client`` was sent, with the md5 salt and the BackendKeyData
        zeroed, once the key is checked against the one registered for it."""
        sent = bytearray(client.transport.data)
        pos = 0
        while pos + 5 <= len(sent):
            kind, length = sent[pos : pos + 1], struct.unpack_from("!i", sent, pos + 1)[0]
            if kind == b"R" and sent[pos + 5 : pos + 9] == b"\0\0\0\x05":
                sent[pos + 9 : pos + 13] = bytes(4)  # the md5 salt
            elif kind == b"K":
                key = struct.unpack_from("!iI", sent, pos + 5)
                assert key == client.cancel_key
                assert self.proxy.cancel_keys[key] is client
                assert pid_base(key[0]) == self.proxy.cancel_pid_base
                sent[pos + 5 : pos + 13] = bytes(8)
            pos += 1 + length
        return bytes(sent)


def python_login_chunks(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The chunks ClientLogin (the Python login) is handed from now on."""
    seen: list[bytes] = []
    python_login = ClientConnection._data_received
    monkeypatch.setattr(
        ClientConnection,
        "_data_received",
        lambda self, data: (seen.append(data), python_login(self, data)),
    )
    return seen


def pid_base(pid: int) -> int:
    """A cancel key's pid without its random bits."""
    return pid & ~RANDOM_MASK


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.AbstractEventLoop]:
    with offline_loop(monkeypatch) as loop:
        yield loop


login = st.tuples(
    st.just("login"),
    st.sampled_from(["app", "app", "app", "other", "nobody"]),
    st.sampled_from(["pgbench", "pgbench", "web"]),
    st.sampled_from(["right", "right", "right", "wrong"]),
    st.booleans(),
)
actions = st.lists(
    st.one_of(
        login,
        login,
        login,
        login,
        login,
        login,
        st.tuples(st.just("leave"), st.integers(0, 30)),
        st.tuples(st.just("leave"), st.integers(0, 30)),
        st.tuples(st.just("reload"), st.sampled_from(["secret2", "secret3"])),
        st.tuples(st.just("stale_pool")),
        st.tuples(st.just("drain")),
    ),  # fmt: skip
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("auth_type", ["md5", "trust"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=actions, max_clients=st.sampled_from([4, 100]))
def test_compiled_logins_match_the_python_login(
    loop: asyncio.AbstractEventLoop, auth_type: str, script: list[tuple[Any, ...]], max_clients: int
) -> None:
    rigs = [Rig(auth_type, max_clients, fast=True), Rig(auth_type, max_clients, fast=False)]
    for action, *args in script:
        if action == "login":
            clients = [rig.login(*args) for rig in rigs]
            first, second = (rig.snapshot(c) for rig, c in zip(rigs, clients, strict=True))
            assert first == second, (action, args)
        elif action == "leave":
            for rig in rigs:
                if rig.clients:
                    rig.clients[args[0] % len(rig.clients)].connection_lost(None)
        elif action == "drain":
            for rig in rigs:
                rig.proxy.draining = True
        else:
            for rig in rigs:
                getattr(rig, action)(*args)


def test_a_repeated_login_is_served_by_the_compiled_path(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig("md5", 100, fast=True)
    seen = python_login_chunks(monkeypatch)
    first = rig.login("app", "pgbench", "right", split=False)
    assert first.state == "ready" and len(seen) == 2  # startup and answer: ClientLogin
    seen.clear()
    again = rig.login("app", "pgbench", "right", split=False)
    assert again.state == "ready" and seen == []  # the plan: no Python login at all
    assert again.transport.data.endswith(b"Z\x00\x00\x00\x05I")
    wrong = rig.login("app", "pgbench", "wrong", split=False)
    assert wrong.state == "closed" and len(seen) == 1  # a wrong answer is ClientLogin's
    assert b"28P01" in bytes(wrong.transport.data)
    for answer in ("last_digit_off", "uppercase"):  # every digit is compared, as PostgreSQL does
        seen.clear()
        refused = rig.login("app", "pgbench", answer, split=False)
        assert refused.state == "closed" and len(seen) == 1
        assert b"28P01" in bytes(refused.transport.data)
    seen.clear()
    rig.reload("changed")  # every plan is stale after a reload
    rig.login("app", "pgbench", "right", split=False)
    assert len(seen) == 2


def test_a_plan_still_asks_what_can_change_between_logins(loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig("md5", 2, fast=True)
    planned = rig.login("app", "pgbench", "right", split=False)
    assert planned.state == "ready" and rig.proxy.login_plans
    rig.login("app", "pgbench", "right", split=False)
    refused = rig.login("app", "pgbench", "right", split=False)  # a third client: max_client_conn 2
    assert refused.state == "closed" and b"53300" in bytes(refused.transport.data)
    planned.connection_lost(None)
    old_pool = planned.pool
    rig.stale_pool()
    fresh = rig.login("app", "pgbench", "right", split=False)
    assert fresh.state == "ready" and fresh.pool is not old_pool and not fresh.pool.stale
    rig.proxy.draining = True
    late = rig.login("app", "pgbench", "right", split=False)
    assert late.state == "closed" and b"57P01" in bytes(late.transport.data)


def test_compiled_logins_draw_salts_and_keys_from_the_os_csprng(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As scry.protocol.auth and scry.peering draw theirs: 4 KiB of os.urandom
    # at a time, taken from the end (a predictable key cancels others' queries).
    from scry import _relay

    rig = Rig("md5", 100, fast=True)
    rig.login("app", "pgbench", "right", split=False)  # ClientLogin's, leaves a plan
    drawn: list[int] = []

    def urandom(n: int) -> bytes:
        drawn.append(n)
        return bytes(range(256)) * (n // 256)

    monkeypatch.setattr(_relay._os, "urandom", urandom)
    _relay._forget_entropy()
    try:
        client = rig.login("app", "pgbench", "right", split=False)
    finally:
        _relay._forget_entropy()  # nothing derived from the fake bytes outlives the test
    assert client.state == "ready" and drawn == [4096]
    sent = bytes(client.transport.data)
    assert sent[9:13] == bytes([252, 253, 254, 255])  # the salt: the last 4 bytes
    pid, secret = client.cancel_key
    assert secret == int.from_bytes(bytes([244, 245, 246, 247]), "little")  # then 8 more
    assert pid & RANDOM_MASK == int.from_bytes(bytes([248, 249]), "little") & RANDOM_MASK
    assert key_owner(pid) == key_owner(rig.proxy.cancel_pid_base) == (0, 0)
    assert rig.proxy.cancel_keys[pid, secret] is client


def test_cancel_keys_follow_a_reloaded_peer_id(loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig("md5", 100, fast=True)
    new = config("md5", PASSWORDS).model_copy(update={"peer_id": 7})
    rig.proxy.apply_config(new)
    rig._warm_pools()
    rig.login("app", "pgbench", "right", split=False)
    compiled = rig.login("app", "pgbench", "right", split=False)
    assert compiled.state == "ready"
    assert key_owner(compiled.cancel_key[0]) == (7, peering.key_owner(rig.proxy.cancel_pid_base)[1])


def test_settings_postgres_accepted_before_need_no_check_and_get_a_plan(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JDBC-like client's settings (a reported one that differs from the
    server's default, one PostgreSQL spells otherwise, one it does not report)
    that the pool has seen PostgreSQL accept: the login ends at once, greets
    with PostgreSQL's spelling, and the next one is the compiled path's."""
    rig = Rig("md5", 100, fast=True)
    target = rig.proxy.targets["app"]
    pool = rig.proxy.pool_for(target, *rig.proxy.auth.server_credentials(target, "app"))
    pool.welcome = {"server_version": "16.0", "DateStyle": "ISO, MDY", "TimeZone": "UTC"}
    pool.setting_spellings.update(
        {
            ("DateStyle", "iso"): "ISO, MDY",
            ("DateStyle", "ISO, MDY"): "ISO, MDY",
            ("TimeZone", "Asia/Tokyo"): "Asia/Tokyo",
            ("extra_float_digits", "3"): "3",
        }
    )
    wanted = {"DateStyle": "iso", "TimeZone": "Asia/Tokyo", "extra_float_digits": "3"}
    body = struct.pack("!i", 196608) + b"user\0app\0database\0app\0"
    body += b"".join(f"{k}\0{v}\0".encode() for k, v in wanted.items()) + b"\0"
    packet = struct.pack("!i", len(body) + 4) + body
    seen = python_login_chunks(monkeypatch)
    clients = []
    for _ in range(2):
        client = ClientConnection(rig.proxy)
        client.connection_made(Recorder())
        client.data_received(packet)
        salt = bytes(client.transport.data)[9:13]
        client.data_received(md5_answer("app", "pw", salt))
        assert client.state == "ready"  # (no task: nothing to check)
        sent = bytes(client.transport.data)
        assert b"DateStyle\0ISO, MDY\0" in sent and b"TimeZone\0Asia/Tokyo\0" in sent
        assert client.params == {"DateStyle": "ISO, MDY", "TimeZone": "Asia/Tokyo",
                                 "extra_float_digits": "3"}  # fmt: skip
        clients.append(client)
    assert len(seen) == 2  # the first login's startup and answer; the second was planned
