"""A worker the supervisor started again takes the state its instance is in.

A worker that died is started again (``--restarted``). Its config file says
nothing of what an operator did to the running instance since: a PAUSE (the
admin API's ``/pause``, SIGUSR1) or a manual breaker trip (``/breaker/trip``,
held until a reset). Before it listens, and so before any client lands on
it (until then the port is the other workers' alone), it asks the other
workers over their peering sockets and does the same here.
scry.pgbouncer.instance asks for the console's state (PAUSE, SUSPEND,
DISABLE, SET, and held breakers) with :func:`ask_the_others` instead.

A worker that finds nobody to ask logs a warning and starts as its config
says; each question waits at most ``WORKER_TIMEOUT`` (1 s).

A new instance started with ``--replace`` takes the same state from the
instance it replaces: it comes with the listening sockets that instance
hands over (scry.peering), and is taken before they are served.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scry.adminapi.instance import WORKER_TIMEOUT, Instance
from scry.adminapi.local import EVERY_DATABASE
from scry.log import event

if TYPE_CHECKING:
    from scry.proxy import Proxy

__all__ = ["ask_the_others", "rejoin", "take_held_breakers", "take_replaced_state"]


async def ask_the_others(
    proxy: Proxy, request: dict[str, Any], timeout: float = WORKER_TIMEOUT
) -> tuple[int, Any] | None:
    """The lowest-numbered other worker's answer to ``request``, asked before
    this worker listens; None, said in a warning, if no other worker answered."""
    proxy.peering.locate(proxy.config.listen_host_port[1])  # (its own socket comes later)
    me = proxy.worker_id
    others = {w: request for w in range(proxy.identity.workers) if w != me}
    gathered = await Instance(proxy).gather(others, timeout)
    if not gathered.answers:
        why = dict(gathered.missing) | {w: e.message for w, e in gathered.errors.items()}
        event("no other worker said the instance's state; starting as the config says",
              logging.WARNING, missing=why)  # fmt: skip
        return None
    return min(gathered.answers.items())


async def rejoin(proxy: Proxy) -> None:
    """Take the other workers' paused databases and held breakers."""
    try:
        await _take_state(proxy)
    except Exception as exc:  # (a worker's odd answer: start as the config says)
        event("could not take the instance's state from the other workers", logging.ERROR,
              error=repr(exc))  # fmt: skip


async def _take_state(proxy: Proxy) -> None:
    answer = await ask_the_others(proxy, {"view": "instance_state"})
    if answer is None:
        return
    worker, theirs = answer
    await _take(proxy, theirs, "took the instance's state from another worker", worker_from=worker)


async def take_replaced_state(proxy: Proxy) -> None:
    """``--replace``: be paused, and hold breakers open, as the instance that
    handed its listening sockets over was (Peering.replaced_state), before
    serving them. From a pgbouncer.ini, that is the console's state (PAUSE,
    SUSPEND, DISABLE; not SET)."""
    state = proxy.peering.replaced_state
    if state is None:
        return
    try:
        if proxy.config.pgbouncer is None:
            await _take(proxy, state["instance"], "took the replaced instance's state")
        elif state.get("console") is not None:
            from scry.pgbouncer.instance import adopt_replaced_console_state

            await adopt_replaced_console_state(proxy, state["console"])
    except Exception as exc:  # (an odd answer: start as the config says)
        event("could not take the replaced instance's state", logging.ERROR,
              error=repr(exc))  # fmt: skip


async def _take(proxy: Proxy, state: dict[str, Any], said: str, **where: object) -> None:
    paused, held = state["paused"], state["held_breakers"]
    for database in paused:
        await proxy.pause(None if database == EVERY_DATABASE else database)
    take_held_breakers(proxy, held)
    if paused or held:
        event(said, **where, paused=paused, breakers_held=[m["db"] for m in held])


def take_held_breakers(proxy: Proxy, messages: list[dict[str, Any]]) -> None:
    """Open, and hold, the breakers another worker holds open (``instance_state``)."""
    for message in messages:
        proxy.peering.apply_breaker(message)
