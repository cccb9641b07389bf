"""The ``pgbouncer`` console of an instance with several workers.

With ``workers: N`` a console session lands on whichever worker the kernel
gave its connection (or on worker 0, which alone serves the Unix socket).
That worker answers for the whole instance, as PgBouncer's single process
would:

* SHOW asks every worker over its peering socket (``{"op": "admin",
  "view": "console"}``, answered by each worker's own console) and merges
  the rows (scry.pgbouncer.merge). SHOW FINGERPRINTS is the admin API's
  ranking of the instance instead (scry.adminapi.instance): percentiles do
  not add up from the workers' rows, their histograms do;
* commands (PAUSE, RESUME, RELOAD, SET, KILL, SHUTDOWN...) run on every
  worker, and the answer comes when all have answered (a PAUSE, when every
  worker's servers are released). Refused everywhere, the answer is the
  error; refused by some (one worker alone was paused by a SIGUSR1),
  it is the success, with a NOTICE naming each refusal;
* KILL_CLIENT goes to the worker that owns the id (ids are instance-wide:
  scry.pgbouncer.merge.instance_id).

A worker that does not answer in time is left out and named in a notice;
the session never hangs on a sick worker for a SHOW. A worker the supervisor
starts again after a crash takes what the console set from the others
(:func:`adopt_console_state`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

# (Loaded with the console, before scry-pgbouncer switches user: the interpreter's
# files may be unreadable after that, as are the admin API's, which this uses.)
from scry.adminapi.errors import ApiError
from scry.adminapi.instance import Instance
from scry.adminapi.local import held_breakers
from scry.adminapi.rejoin import ask_the_others, take_held_breakers
from scry.log import event
from scry.pgbouncer.commands import reload_pgbouncer_config
from scry.pgbouncer.merge import MERGERS, local_id, merge_show, parse_answer
from scry.pgbouncer.results import READY, error
from scry.pgbouncer.state import state_for
from scry.pgbouncer.views import FINGERPRINTS_SHOWN, fingerprints_result
from scry.protocol import messages as m

if TYPE_CHECKING:
    from scry.pgbouncer.dispatch import AdminConsole
    from scry.proxy import Proxy

__all__ = ["adopt_console_state", "answer_for_instance", "console_state"]

#: Seconds each worker gets for a SHOW, and for a command that does not wait.
SHOW_TIMEOUT = 1.0
COMMAND_TIMEOUT = 10.0
#: Commands that wait for the pools (PAUSE, SUSPEND, WAIT_CLOSE): as long as
#: they take, as in PgBouncer.
WAITING_TIMEOUT = 24 * 3600.0
_WAITING = frozenset({"pause", "suspend", "wait_close"})
#: SHOWs made from the workers' merged statistics, not from their rows.
_FROM_STATISTICS = frozenset({"fingerprints"})
#: SHUTDOWN: how long the others get to take it before this one runs it (an
#: immediate one answers nobody; WAIT_FOR_* answer at once).
SHUTDOWN_GRACE = 2.0


class Route(enum.Enum):
    HERE = "here"  # the same on every worker (SHOW VERSION, SET client_encoding...)
    SHOW = "show"  # every worker's rows, merged
    EVERYWHERE = "everywhere"  # a command every worker runs
    OWNER = "owner"  # KILL_CLIENT: the worker that owns the id
    STOP = "stop"  # SHUTDOWN: the others first (this one may stop before it could answer)


def route(command: str, arg: str) -> Route:
    """Where ``command`` (a console statement's first word, lowercase; ``set``
    for ``SET key = value``) runs."""
    if command in ("show", "select"):
        view = arg.lower()
        return Route.SHOW if view in MERGERS or view in _FROM_STATISTICS else Route.HERE
    if command == "kill_client":
        return Route.OWNER
    if command == "shutdown":
        return Route.STOP
    return Route.EVERYWHERE


async def answer_for_instance(console: AdminConsole, sql: str, where: Route, arg: str) -> bytes:
    """The answer to ``sql`` for the whole instance (see the module's docstring)."""
    me = console.proxy.worker_id
    others = [w for w in range(console.workers) if w != me]
    if where is Route.STOP:
        if console.admin:  # (a stats user is refused here, and nowhere else asked)
            await _ask(console, dict.fromkeys(others, sql), SHUTDOWN_GRACE)
        return await _settled(console.answer_here(sql))
    if where is Route.OWNER:
        return await _kill_client(console, sql, arg)
    own = console.answer_here(sql)
    if where is Route.HERE:
        return await _settled(own)
    if where is Route.SHOW:
        assert isinstance(own, bytes)
        if parse_answer(own).error is not None:
            return own  # (an unknown view, or SHOW FDS for a stats user: the same everywhere)
        if arg.lower() == "fingerprints":
            return await _show_fingerprints(console)
        answers, missing = await _ask(console, dict.fromkeys(others, sql), SHOW_TIMEOUT)
        answers[me] = own
        return _notices(missing) + merge_show(arg.lower(), answers, me, console.workers)
    if not console.admin:
        return await _settled(own)  # "admin access needed", on every worker
    command = sql.split(None, 1)[0].lower().strip(";")
    timeout = WAITING_TIMEOUT if command in _WAITING else COMMAND_TIMEOUT
    (answers, missing), mine = await asyncio.gather(
        _ask(console, dict.fromkeys(others, sql), timeout), _settled(own)
    )
    answers[me] = mine
    errors = {w: parse_answer(a).error for w, a in answers.items()}
    done = [w for w in sorted(answers) if errors[w] is None]
    if not done:
        return _notices(missing) + answers[me]  # refused everywhere: one error
    # Refused by some: their state differed (a signal to one worker alone...).
    refusals = []
    for worker, refusal in sorted(errors.items()):
        if refusal is not None:
            text = f"worker {worker}: {refusal.get('M', 'error')}"
            if worker != me:  # (this one's refusal is logged as a console error already)
                event("console command refused by a worker", logging.WARNING, error=text)
            refusals.append(m.notice_response(text))
    return _notices(missing) + b"".join(refusals) + answers[me if me in done else done[0]]


async def _show_fingerprints(console: AdminConsole) -> bytes:
    """The instance's heaviest fingerprints, their p99 from the workers'
    histograms added up (the largest worker's p99 would only bound it)."""
    instance = Instance(console.proxy, SHOW_TIMEOUT)
    try:
        top = await instance.top(instance.scope(None), "total_time", FINGERPRINTS_SHOWN, None)
    except ApiError as exc:  # (no worker answered, or one failed while asked for details)
        return error(exc.message) + READY
    missing = {gone.worker: gone.error for gone in top.fleet.missing} if top.fleet else {}
    return _notices(missing) + fingerprints_result(q.model_dump() for q in top.queries)


async def _kill_client(console: AdminConsole, sql: str, arg: str) -> bytes:
    wanted = arg.lstrip("cC")
    if not console.admin or not (wanted.isascii() and wanted.isdigit()):
        return await _settled(console.answer_here(sql))  # its error, as one worker says it
    worker, own_id = local_id(int(wanted), console.workers)
    local_sql = f"KILL_CLIENT {own_id}"
    if worker == console.proxy.worker_id:
        return await _settled(console.answer_here(local_sql))
    answers, missing = await _ask(console, {worker: local_sql}, COMMAND_TIMEOUT)
    if worker in answers:
        return answers[worker]
    return _notices(missing) + error("client not found") + READY


async def _ask(
    console: AdminConsole, statements: dict[int, str], timeout: float
) -> tuple[dict[int, bytes], dict[int, str]]:
    """Each worker's answer to its statement, and why each worker that
    gave none did not (over the peering sockets: scry.adminapi.instance)."""
    requests = {
        worker: {"view": "console", "sql": sql, "user": console.user, "admin": console.admin}
        for worker, sql in statements.items()
    }
    gathered = await Instance(console.proxy).gather(requests, timeout)
    answers = {w: a.encode("latin-1") for w, a in gathered.answers.items()}
    missing = dict(gathered.missing)
    missing.update((w, e.message) for w, e in gathered.errors.items())
    return answers, missing


async def _settled(answer: bytes | Awaitable[bytes]) -> bytes:
    return answer if isinstance(answer, bytes) else await answer


def _notices(missing: dict[int, str]) -> bytes:
    """A NoticeResponse per worker left out of the answer (logged once, too)."""
    out = []
    for worker, why in sorted(missing.items()):
        event("console: a worker did not answer", logging.WARNING, worker=worker, error=why)
        out.append(m.notice_response(f"worker {worker} did not answer ({why}); left out"))
    return b"".join(out)


# --------------------------------------------------------------------------- #
# A worker (re)started into a running instance
# --------------------------------------------------------------------------- #


def console_state(proxy: Proxy) -> dict[str, Any]:
    """What the console's commands have set on this worker (the ``console_state``
    view of scry.adminapi.local)."""
    st = state_for(proxy)
    return {
        "paused_all": st.paused_all, "paused": sorted(st.paused), "suspended": st.suspended,
        "disabled": sorted(st.disabled), "overrides": dict(st.overrides),
        "held_breakers": held_breakers(proxy),  # (the admin API's trips)
    }  # fmt: skip


async def adopt_console_state(proxy: Proxy) -> None:
    """In a worker the supervisor started again (the one before died): take
    what the console set on the other workers (PAUSE, SUSPEND, DISABLE, SET)
    and the breakers the admin API holds open there, so that it is in the
    instance's state, not the ini's."""
    answer = await ask_the_others(proxy, {"view": "console_state"}, SHOW_TIMEOUT)
    if answer is None:
        return
    worker, theirs = answer
    await _adopt(proxy, theirs, "took the console's state from another worker", worker_from=worker)


async def adopt_replaced_console_state(proxy: Proxy, theirs: dict[str, Any]) -> None:
    """``--replace``: take the console state of the instance replaced (its
    ``console_state``), except SET: the new process's ini says what it says,
    as a restarted PgBouncer's does."""
    await _adopt(proxy, {**theirs, "overrides": {}}, "took the replaced instance's console state")


async def _adopt(proxy: Proxy, theirs: dict[str, Any], said: str, **where: object) -> None:
    st = state_for(proxy)
    settings = {k: v for k, v in theirs["overrides"].items() if st.overrides.get(k) != v}
    flags = ("paused_all", "paused", "suspended", "disabled", "held_breakers")
    if not settings and not any(theirs[flag] for flag in flags):
        return  # (nothing set there that is not set here)
    if settings:
        st.overrides.update(settings)
        reload_pgbouncer_config(proxy)
    take_held_breakers(proxy, theirs["held_breakers"])
    st.disabled.update(theirs["disabled"])
    st.suspended = st.suspended or theirs["suspended"]
    pausing = []
    if theirs["paused_all"]:
        st.paused_all = True
        pausing.append(None)
    for database in theirs["paused"]:
        st.paused.add(database)
        pausing.append(database)
    for database in pausing:
        await proxy.pause(database)
    event(said, **where,
          paused=theirs["paused_all"] or theirs["paused"] or False,
          suspended=theirs["suspended"], disabled=theirs["disabled"],
          set=sorted(settings), breakers_held=[b["db"] for b in theirs["held_breakers"]])  # fmt: skip
