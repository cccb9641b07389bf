"""What the console keeps per proxy, and PgBouncer's ``*`` (autodb) databases.

PgBouncer's commands set flags that outlive the session that ran them (PAUSE,
DISABLE, SET ...); they live in a :class:`ConsoleState` attached to the proxy.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scry.log import event

if TYPE_CHECKING:
    from scry.pgbouncer.session import ConsoleSession
    from scry.proxy import Proxy


@dataclass
class ConsoleState:
    """What the console keeps for one proxy: flags PgBouncer's commands set."""

    sessions: set[ConsoleSession] = field(default_factory=set)
    disabled: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)  # PAUSE db / KILL db
    paused_all: bool = False
    suspended: bool = False
    #: Logins that came during SUSPEND: each goes on when called (at RESUME).
    held_logins: list[Callable[[], None]] = field(default_factory=list)
    shutting_down: bool = False
    #: [pgbouncer] settings changed with SET, applied on top of the file.
    overrides: dict[str, str] = field(default_factory=dict)
    #: Re-read the pgbouncer.ini and apply it (set by scry-pgbouncer / scry serve).
    reload: Callable[[], None] | None = None
    #: (time.monotonic(), {database: totals}) for SHOW STATS averages.
    snapshots: deque[tuple[float, dict[str, list[int]]]] = field(default_factory=deque)
    warned: set[str] = field(default_factory=set)
    #: The Unix socket file this process created (removed at exit), and what
    #: tells it from a file a replacing process made at the same path since.
    unix_path: str | None = None
    unix_file: tuple[int, int, int] | None = None
    #: Databases made from ``*``: name -> when last seen in use (time.monotonic()).
    autodb: dict[str, float] = field(default_factory=dict)


_states: weakref.WeakKeyDictionary[Proxy, ConsoleState] = weakref.WeakKeyDictionary()


def state_for(proxy: Proxy) -> ConsoleState:
    """The console state of ``proxy`` (created on first use)."""
    state = _states.get(proxy)
    if state is None:
        state = _states[proxy] = ConsoleState()
    return state


def autodb_target(proxy: Proxy, database: str) -> Any:
    """A target for ``database`` made from the ``*`` entry (PgBouncer's autodb)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    compat = proxy.config.pgbouncer
    assert compat is not None and compat.autodb is not None
    url = compat.autodb.database_url
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        url = urlunsplit(parts._replace(path="/" + quote(database, safe="")))
    db = compat.autodb.model_copy(update={"database_url": url})
    try:
        target = proxy.config.model_copy(update={"databases": {database: db}}).targets()[database]
    except Exception as exc:  # a bad name cannot make a good URL
        event("autodb failed", logging.WARNING, database=database, error=str(exc))
        return None
    proxy.targets[database] = target
    state_for(proxy).autodb[database] = time.monotonic()
    return target


def free_idle_autodbs(proxy: Proxy, now: float) -> None:
    """autodb_idle_timeout (the janitor's): forget a database made from ``*``
    that no client and no server has used for that long, as PgBouncer frees
    it, so that names asked for once do not pile up."""
    compat = proxy.config.pgbouncer
    state = _states.get(proxy)
    if compat is None or state is None or not state.autodb:
        return
    in_use = {client.database for client in proxy.clients}
    for (database, _user), pool in proxy.pools.items():
        if pool.servers or pool.connecting or pool.waiters:
            in_use.add(database)
    timeout = compat.autodb_idle_timeout
    for database, seen in list(state.autodb.items()):
        if database in in_use:
            state.autodb[database] = now
        elif timeout and now - seen >= timeout:
            del state.autodb[database]
            proxy.targets.pop(database, None)
            for key in [key for key in proxy.pools if key[0] == database]:
                proxy.free_pool(key, "autodb_idle_timeout")
            proxy.breakers.pop(database, None)
            proxy.host_rotations.pop(database, None)
            proxy.health.pop(database, None)
            event("autodb freed", database=database, idle=round(now - seen))
