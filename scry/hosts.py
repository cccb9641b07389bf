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
