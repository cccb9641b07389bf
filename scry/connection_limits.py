"""max_db_connections and max_user_connections: server connections several pools share.

A pool is one (database, user) pair, and its ``size`` bounds only its own
servers. PgBouncer's ``max_db_connections`` bounds the servers of every pool of
one database together, ``max_user_connections`` those of every pool of one
user (the user scry logs in to PostgreSQL as). scry reads both from the pool
settings (``pool.max_db_connections``, ``pool.max_user_connections``; 0 means
no limit), so a database entry or a ``[users]`` line can set its own.

When a pool wants a server and a limit is reached, room is made as PgBouncer
makes it: an idle server of another pool under the same limit is closed (the
one idle longest; a server parked with a client between transactions counts as
idle). PgBouncer stops there, so a pool whose peers never go idle starves until
``query_wait_timeout``. scry also asks a peer that holds at least two servers
more than the waiting pool (so giving one up never makes it the smaller one,
and two pools never trade a server back and forth) to close one busy server
when its transaction ends; the waiting pool opens its server when that one
closes. Each waiting pool has one such claim at a time. A blocked pool also
tries again after 10 ms, doubling to 100 ms (``Pool.retry_when_room``), so a
peer server that goes idle in the meantime is taken soon after, where
PgBouncer's maintenance on every loop turn takes it at once.

A server scry closes counts against the limit until PostgreSQL has closed the
connection too (``Pool.exiting``; ``ServerConnection.close``), so its
replacement never logs in while the old backend still runs and PostgreSQL
never sees more than the limit. PgBouncer opens the replacement at once.

Nothing here runs per query: only when a pool opens a server and when one closes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from scry.log import event
from scry.server import CLOSED, IDLE

if TYPE_CHECKING:
    from scry.pool import Pool
    from scry.server import ServerConnection

__all__ = ["EVICTED", "limited", "room_for_one_more", "server_closed"]

EVICTED = "evicted (max_db_connections / max_user_connections)"

# Set while a pool makes room for itself: the servers it closes must not wake
# other blocked pools, which would take the room it made.
_making_room = False


def limited(pool: Pool) -> bool:
    """Whether a connection limit applies to ``pool`` at all."""
    settings = pool.settings
    return bool(settings.max_db_connections or settings.max_user_connections)


def room_for_one_more(pool: Pool, pools: Iterable[Pool]) -> bool:
    """May ``pool`` open a server now? Closes an idle server of another pool to make room.

    Only for clients that wait (``pool.starved``): ``min_size`` alone never
    takes servers from other pools, or two pools would take turns forever.
    False means it may not: a starved pool is marked blocked and may claim one
    busy server of a larger peer; :func:`server_closed` wakes it.
    """
    global _making_room
    pools = list(pools)
    pool.limit_blocked = False
    starved = pool.starved
    for limit, peers, what in _limits_of(pool, pools):
        others = [p for p in peers if p is not pool]
        if starved:
            _making_room = True
            try:
                while sum(map(_open, peers)) >= limit and _close_longest_idle(others):
                    pass
            finally:
                _making_room = False
        if sum(map(_count, peers)) >= limit:
            if starved:
                pool.limit_blocked = True
                if sum(map(_open, peers)) >= limit:  # (else a backend exits to make room)
                    _claim_busy(pool, others, what, limit)
                pool.retry_when_room()
            return False
    return True


def server_closed(pool: Pool, server: ServerConnection | None, pools: Iterable[Pool]) -> None:
    """``server`` of ``pool`` closed (None: one failed to open): blocked peers may
    open one now, the pool that claimed it first."""
    if _making_room:
        return
    pools = list(pools)
    for _limit, peers, _what in _limits_of(pool, pools):
        claimant = next((p for p in peers if server is not None and p.limit_claim is server), None)
        if claimant is not None:
            claimant.limit_claim = None
            peers.remove(claimant)
            peers.insert(0, claimant)
        for peer in peers:
            if peer.limit_blocked:
                peer.room_made()


def _limits_of(pool: Pool, pools: list[Pool]) -> list[tuple[int, list[Pool], str]]:
    settings = pool.settings
    found = []
    if settings.max_db_connections:
        name = pool.target.name
        peers = [p for p in pools if p.target.name == name]
        found.append((settings.max_db_connections, peers, f"database {name}"))
    if settings.max_user_connections:
        user = pool.server_user
        peers = [p for p in pools if p.server_user == user]
        found.append((settings.max_user_connections, peers, f"user {user}"))
    return found


def _open(pool: Pool) -> int:
    """Servers open or opening."""
    return len(pool.servers) + pool.connecting


def _count(pool: Pool) -> int:
    """What the limit counts: servers open or opening, and closed ones whose
    backends have not exited yet (PostgreSQL still counts those)."""
    return len(pool.servers) + pool.connecting + pool.exiting


def _close_longest_idle(peers: list[Pool]) -> bool:
    """Close the server idle longest among ``peers`` (a parked one if none is idle)."""
    oldest: ServerConnection | None = None
    for peer in peers:
        for server in peer.idle:  # (the left end is the longest idle: pools pop the right)
            if server.state is IDLE and (oldest is None or server.last_used < oldest.last_used):
                oldest = server
            break
    if oldest is not None:
        oldest.close(EVICTED)
        return True
    return any(peer.close_parked_server(EVICTED) for peer in peers)


def _claim_busy(pool: Pool, others: list[Pool], what: str, limit: int) -> None:
    claim = pool.limit_claim
    if claim is not None and claim.state is not CLOSED:
        return  # one claim at a time
    mine = _open(pool)
    richest = max(others, key=_open, default=None)
    if richest is None or _open(richest) <= mine + 1:
        return  # no peer holds more than its share: wait for one to go idle or close
    for server in richest.servers:
        if not server.retire:
            server.retire = True  # closed, not reused, when its client gives it back
            server.evicted = True
            pool.limit_claim = server
            event("server claimed", pool=pool.name, from_pool=richest.name, server=server.id,
                  limit=f"{what}: {limit}")  # fmt: skip
            return
