"""scry.dns: the server host name cache (dns_max_ttl, dns_nxdomain_ttl), with a stub resolver."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from scry.dns import DnsCache, is_address


class StubResolver:
    """getaddrinfo's answers by name, counting the lookups; ``gate`` holds them."""

    def __init__(self, answers: dict[str, list[str] | OSError]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, host: str, port: int) -> list[Any]:
        self.calls.append(host)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers[host]
        if isinstance(answer, OSError):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answer]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_is_address() -> None:
    assert is_address("10.0.0.1") and is_address("::1")
    assert not is_address("db.example.com") and not is_address("localhost")


async def test_addresses_are_kept_for_max_ttl_and_handed_out_in_turn() -> None:
    clock = Clock()
    stub = StubResolver({"db": ["10.0.0.1", "10.0.0.2", "10.0.0.1"]})
    cache = DnsCache(clock, stub)
    assert await cache.addresses("db", 5432, 15, 15) == ["10.0.0.1", "10.0.0.2"]
    assert await cache.addresses("db", 5432, 15, 15) == ["10.0.0.2", "10.0.0.1"]
    clock.now += 14.9
    assert await cache.addresses("db", 5432, 15, 15) == ["10.0.0.1", "10.0.0.2"]
    assert stub.calls == ["db"] and cache.queries == 1
    assert cache.rows() == [("db", 0, "10.0.0.1:0,10.0.0.2:0")]
    stub.answers["db"] = ["10.0.0.3"]  # (moved: seen once the entry expires)
    clock.now += 0.1
    assert await cache.addresses("db", 5432, 15, 15) == ["10.0.0.3"]
    assert stub.calls == ["db", "db"]
    assert cache.rows() == [("db", 15, "10.0.0.3:0")]


async def test_an_address_needs_no_lookup() -> None:
    stub = StubResolver({})
    cache = DnsCache(Clock(), stub)
    assert await cache.addresses("127.0.0.1", 5432, 15, 15) == ["127.0.0.1"]
    assert stub.calls == [] and cache.rows() == []


async def test_a_failed_lookup_is_kept_for_nxdomain_ttl() -> None:
    clock = Clock()
    stub = StubResolver({"gone": socket.gaierror(socket.EAI_NONAME, "Name or service not known")})
    cache = DnsCache(clock, stub)
    for _ in range(2):
        with pytest.raises(socket.gaierror, match="not known"):
            await cache.addresses("gone", 5432, 15, 5)
    assert stub.calls == ["gone"]
    assert cache.rows() == [("gone", 5, "")]
    stub.answers["gone"] = ["10.0.0.9"]
    clock.now += 5
    assert await cache.addresses("gone", 5432, 15, 5) == ["10.0.0.9"]


async def test_zero_ttl_looks_up_every_time() -> None:
    stub = StubResolver({"db": ["10.0.0.1"]})
    cache = DnsCache(Clock(), stub)
    for _ in range(3):
        assert await cache.addresses("db", 5432, 0, 0) == ["10.0.0.1"]
    assert stub.calls == ["db"] * 3


async def test_concurrent_connects_share_one_lookup_that_outlives_a_cancelled_one() -> None:
    stub = StubResolver({"db": ["10.0.0.1"]})
    stub.gate = asyncio.Event()
    cache = DnsCache(Clock(), stub)
    first = asyncio.ensure_future(cache.addresses("db", 5432, 15, 15))
    second = asyncio.ensure_future(cache.addresses("db", 5432, 15, 15))
    await asyncio.sleep(0)  # (both are now waiting on the one lookup)
    assert cache.pending == 1
    first.cancel()  # its connect timed out: the lookup goes on for the other
    with pytest.raises(asyncio.CancelledError):
        await first
    stub.gate.set()
    assert await second == ["10.0.0.1"]
    assert stub.calls == ["db"] and cache.pending == 0


async def test_show_dns_hosts_prints_socket_addresses_as_pgbouncer() -> None:
    cache = DnsCache(Clock(), StubResolver({"db": ["::1", "127.0.0.1"]}))
    await cache.addresses("db", 5432, 15, 15)
    assert cache.rows() == [("db", 15, "[::1]:0,127.0.0.1:0")]
