"""The compiled login fast path (ClientCore._startup_fast) against ClientLogin.

A login through ClientLogin leaves a LoginPlan for its exact StartupMessage;
the next client that sends the same bytes is logged in by the compiled
ClientCore from the plan. Two proxies are driven through the same random
sequence of logins (right, wrong and split md5 answers, unknown users,
several startup packets, reloads that change a password, a pool that goes
stale, max_client_conn reached, a drain): in one every chunk goes through
``data_received``, in the other straight to ``_data_received`` (the Python
login, the reference). Salts and cancel keys are drawn from the same
deterministic sequences in both; after every login the bytes each client was
sent and the fields a login sets must be the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from fake_transport import Recorder, msg, offline_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scry import proxy as proxy_module
from scry import relay_core
from scry.client import ClientConnection
from scry.config import Config
from scry.protocol import auth as auth_module
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
        self.salts = (bytes([i % 256, i // 256 % 256, 7, 9]) for i in itertools.count(1))
        self.keys = ((1000 + i, 5000 + i) for i in itertools.count(1))
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
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(auth_module, "_random_salt", lambda: next(self.salts))
            mp.setattr(proxy_module, "new_cancel_key", lambda peer, worker: next(self.keys))
            (client.data_received if self.fast else client._data_received)(data)

    def login(self, user: str, app: str, answer: str, split: bool) -> ClientConnection:
        client = ClientConnection(self.proxy)
        client.connection_made(Recorder())
        self.clients.append(client)
        self.sends(client, startup(user, app))
        sent = bytes(client.transport.data)
        if self.auth_type == "md5" and sent[:1] == b"R" and sent[8:9] == b"\x05":
            salt = sent[9:13]
            password = {"right": self.passwords.get(user, "x"), "wrong": "nope"}[answer]
            reply = md5_answer(user, password, salt)
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
            bytes(client.transport.data), client.state, client.user, client.database,
            client.params, client.state == "ready" and id(client.params), client.application_name, pool.name if pool else None,
            pool.stale if pool else None, client.transaction_pooling, client.statement_pooling,
            type(client.tracker).__name__, getattr(client.tracker, "client_id", client.id) == client.id,
            client.context and (client.context.client_id == client.id, client.context[1:]),
            client.cancel_key,
            client._auth is None, client._reader is None, sorted(self.proxy.cancel_keys),
            len(self.proxy.clients),
        )  # fmt: skip


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
    seen: list[bytes] = []
    python_login = ClientConnection._data_received
    monkeypatch.setattr(
        ClientConnection,
        "_data_received",
        lambda self, data: (seen.append(data), python_login(self, data)),
    )
    first = rig.login("app", "pgbench", "right", split=False)
    assert first.state == "ready" and len(seen) == 2  # startup and answer: ClientLogin
    seen.clear()
    again = rig.login("app", "pgbench", "right", split=False)
    assert again.state == "ready" and seen == []  # the plan: no Python login at all
    assert again.transport.data.endswith(b"Z\x00\x00\x00\x05I")
    wrong = rig.login("app", "pgbench", "wrong", split=False)
    assert wrong.state == "closed" and len(seen) == 1  # a wrong answer is ClientLogin's
    assert b"28P01" in bytes(wrong.transport.data)
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
