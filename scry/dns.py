"""PgBouncer's DNS cache: where a server host name points, looked up once per TTL.

A host name of a database (not an IP address, not a Unix socket directory)
is looked up with the system resolver (``getaddrinfo``, in the event loop's
thread pool) and its addresses kept for ``dns_max_ttl`` seconds; a failed
lookup is kept, and raised again, for ``dns_nxdomain_ttl``. PgBouncer ignores
the record's own TTL the same way. 0 looks the name up at every connect.

A name with several addresses hands them out in turn, as PgBouncer does,
except that one connection tries the rest of them when the first refuses
(``addresses`` returns them all, the next first), where PgBouncer lets that
connection fail. Concurrent connects to a name that is being looked up wait
for the one lookup. SHOW DNS_HOSTS and SHOW LISTS (scry.pgbouncer.views)
read ``entries`` and the counters.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


def is_address(host: str) -> bool:
    """An IPv4 or IPv6 address, which needs no lookup."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _as_socket_address(address: str) -> str:
    return f"[{address}]:0" if ":" in address else f"{address}:0"


@dataclass
class DnsEntry:
    """What one lookup of a name gave: addresses, or the error."""

    addresses: list[str]
    expires: float
    error: OSError | None = None
    turn: int = field(default=0, repr=False)  # where the next connection starts


class DnsCache:
    """Host name -> addresses, for the server connections of one worker."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        getaddrinfo: Callable[[str, int], Awaitable[list[Any]]] | None = None,
    ) -> None:
        self.entries: dict[str, DnsEntry] = {}
        # (None: the running loop's, in its thread pool; tests pass a stub.)
        self._getaddrinfo = getaddrinfo
        self.queries = 0  # lookups made (SHOW LISTS dns_queries)
        self._pending: dict[str, asyncio.Task[DnsEntry]] = {}
        self._clock = clock

    @property
    def pending(self) -> int:
        """Lookups in flight (SHOW LISTS dns_pending)."""
        return len(self._pending)

    async def addresses(
        self, host: str, port: int, max_ttl: float, nxdomain_ttl: float
    ) -> list[str]:
        """``host``'s addresses for one connection, the one whose turn it is
        first; raises the lookup's OSError (``socket.gaierror``) if it failed."""
        if is_address(host):
            return [host]
        entry = self.entries.get(host)
        if entry is None or self._clock() >= entry.expires:
            entry = await self._lookup(host, port, max_ttl, nxdomain_ttl)
        if entry.error is not None:
            # A new exception each time: raising one object again would
            # chain every earlier traceback onto it.
            raise type(entry.error)(*entry.error.args)
        addresses = entry.addresses
        start = entry.turn % len(addresses)
        entry.turn = start + 1
        return [*addresses[start:], *addresses[:start]]

    async def _lookup(self, host: str, port: int, max_ttl: float, nxdomain_ttl: float) -> DnsEntry:
        task = self._pending.get(host)
        if task is None:
            # Its own task: a connect that times out or is cancelled leaves
            # the lookup running for the others, and the answer cached.
            task = asyncio.get_running_loop().create_task(
                self._resolve(host, port, max_ttl, nxdomain_ttl), name=f"scry-dns-{host}"
            )
            self._pending[host] = task
            task.add_done_callback(lambda done: self._pending.pop(host, None))
        return await asyncio.shield(task)

    async def _resolve(self, host: str, port: int, max_ttl: float, nxdomain_ttl: float) -> DnsEntry:
        self.queries += 1
        try:
            if self._getaddrinfo is not None:
                infos = await self._getaddrinfo(host, port)
            else:
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            entry = DnsEntry([], self._clock() + nxdomain_ttl, error=exc)
        else:
            # One of each address, in the resolver's order (its preference).
            found = list(dict.fromkeys(str(info[4][0]) for info in infos))
            entry = DnsEntry(found, self._clock() + max_ttl)
            if not found:  # (getaddrinfo raises instead; kept for a stub resolver)
                entry.error = socket.gaierror(socket.EAI_NONAME, f"no address for {host}")
                entry.expires = self._clock() + nxdomain_ttl
        self.entries[host] = entry
        return entry

    def rows(self) -> list[tuple[str, int, str]]:
        """SHOW DNS_HOSTS: each name, whole seconds left, its addresses as
        PgBouncer prints them (``10.0.0.1:0``, ``[::1]:0``: a socket address
        of the lookup, made without a port)."""
        now = self._clock()
        return [
            (
                host,
                max(0, int(entry.expires - now)),
                ",".join(map(_as_socket_address, entry.addresses)),
            )
            for host, entry in self.entries.items()
        ]
