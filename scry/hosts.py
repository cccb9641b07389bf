"""Which of a database's hosts a new server connection tries, in what order.

A database URL may list several hosts (libpq's syntax; PgBouncer's
``host=h1,h2``). Each new server connection walks the whole list from a
starting host until one accepts the connection, so a host that is down costs
a connection attempt, not a client's error. ``load_balance_hosts`` chooses
the start:

- ``round-robin`` (PgBouncer's default): the host after the previous start,
  so connections spread over all hosts;
- ``disable`` (PgBouncer's and libpq's): the host that last accepted one,
  so all connections stay on one host until it fails, then move on for good;
- ``random`` (libpq's): the whole order shuffled for each connection.

``target_session_attrs`` (libpq's) then skips hosts whose session is not
the kind wanted (``session_matches``): ``primary`` or ``standby`` (hot
standby or not), ``read-write`` or ``read-only`` (also by
``default_transaction_read_only``), ``prefer-standby`` (a standby if any
host is one, else any host). PostgreSQL 14+ reports both settings at login,
so the check costs no query.

One rotation per database and worker (``Proxy.host_rotation``), like
PgBouncer's per-database host index. Pure: no I/O.
"""

from __future__ import annotations

import random

Address = tuple[str, int]


class HostRotation:
    """The order in which one database's hosts are tried, connection after connection."""

    __slots__ = ("hosts", "mode", "_next", "_last_good")

    def __init__(self, hosts: tuple[Address, ...], mode: str) -> None:
        self.hosts = hosts
        self.mode = mode
        self._next = 0  # round-robin: where the next connection starts
        self._last_good = 0  # disable: the host that last accepted a connection

    def order(self) -> list[Address]:
        """The hosts for one new server connection, first choice first."""
        hosts = self.hosts
        if len(hosts) == 1:
            return [hosts[0]]
        if self.mode == "random":
            return random.sample(hosts, len(hosts))
        if self.mode == "disable":
            start = self._last_good
        else:
            start = self._next
            self._next = (start + 1) % len(hosts)
        return [*hosts[start:], *hosts[:start]]

    def connected(self, address: Address) -> None:
        """A connection to ``address`` succeeded (``disable`` stays on it)."""
        if address in self.hosts:
            self._last_good = self.hosts.index(address)


def session_passes(wanted: str) -> list[str]:
    """The kinds of session to look for, one walk over the hosts each."""
    return ["standby", "any"] if wanted == "prefer-standby" else [wanted]


def session_matches(wanted: str, params: dict[str, str]) -> bool:
    """Whether a logged-in server's session (its ParameterStatus values) is
    what ``wanted`` (one of ``session_passes``) asks for. A server that does
    not report ``in_hot_standby`` (before PostgreSQL 14) counts as a primary."""
    standby = params.get("in_hot_standby") == "on"
    if wanted == "primary":
        return not standby
    if wanted == "standby":
        return standby
    read_only = standby or params.get("default_transaction_read_only") == "on"
    if wanted == "read-write":
        return not read_only
    if wanted == "read-only":
        return read_only
    return True  # any
