"""scry.hosts: the order in which a database's hosts are tried."""

from __future__ import annotations

from scry.hosts import HostRotation, session_matches, session_passes

A, B, C = ("a", 5432), ("b", 5432), ("c", 6000)


def test_one_host_is_always_first() -> None:
    for mode in ("round-robin", "disable", "random"):
        rotation = HostRotation((A,), mode)
        assert [rotation.order() for _ in range(3)] == [[A]] * 3


def test_round_robin_starts_each_connection_one_host_further() -> None:
    rotation = HostRotation((A, B, C), "round-robin")
    assert [rotation.order() for _ in range(4)] == [
        [A, B, C], [B, C, A], [C, A, B], [A, B, C],
    ]  # fmt: skip
    rotation.connected(C)  # (success does not change where the next one starts)
    assert rotation.order() == [B, C, A]


def test_disable_stays_on_the_host_that_last_worked() -> None:
    rotation = HostRotation((A, B, C), "disable")
    assert rotation.order() == [A, B, C]
    assert rotation.order() == [A, B, C]
    rotation.connected(B)  # A failed, B took the connection
    assert [rotation.order() for _ in range(2)] == [[B, C, A]] * 2
    rotation.connected(("gone", 1))  # (a host no longer listed changes nothing)
    assert rotation.order() == [B, C, A]


def test_random_tries_every_host_once_in_some_order() -> None:
    rotation = HostRotation((A, B, C), "random")
    orders = [rotation.order() for _ in range(200)]
    assert all(sorted(order) == [A, B, C] for order in orders)
    assert len({order[0] for order in orders}) == 3  # each host comes first sometimes


PRIMARY = {"in_hot_standby": "off", "default_transaction_read_only": "off"}
READ_ONLY_PRIMARY = {"in_hot_standby": "off", "default_transaction_read_only": "on"}
STANDBY = {"in_hot_standby": "on", "default_transaction_read_only": "off"}
OLD_SERVER: dict[str, str] = {}  # (before PostgreSQL 14: neither is reported)


def test_session_matches_as_libpq_reads_the_reported_settings() -> None:
    cases = {
        "any": (True, True, True, True),
        "primary": (True, True, False, True),
        "standby": (False, False, True, False),
        "read-write": (True, False, False, True),
        "read-only": (False, True, True, False),
    }
    for wanted, expected in cases.items():
        got = tuple(
            session_matches(wanted, params)
            for params in (PRIMARY, READ_ONLY_PRIMARY, STANDBY, OLD_SERVER)
        )
        assert got == expected, wanted


def test_prefer_standby_looks_for_a_standby_then_for_anything() -> None:
    assert session_passes("prefer-standby") == ["standby", "any"]
    assert session_passes("read-write") == ["read-write"]
