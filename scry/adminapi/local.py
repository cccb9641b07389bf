"""One worker's answers about itself: views, exports and actions on its own Proxy.

The admin HTTP server (a single process, or worker 0 for its own share) and
the peering socket (worker 0 asking another worker of its instance, see
:mod:`scry.peering`) both come here, so every worker answers alike. Over
peering a request is one JSON object and the answer one JSON document::

    {"op": "admin", "view": NAME, ...parameters}
    -> {"ok": payload}  or  {"error": {"status": 404, "code": "not_found", "message": "..."}}

Views (NAME, parameters):

``status``                 {"status": Status, "summary": StatsTable.export_summary(),
                           "pools": [[database, user], ...]}
``pools`` ``pins`` ``breaker``   the ``admin.schemas`` payload
``clients`` ``servers``    the payload; ``limit``, ``offset`` (limit 0: only the total)
``top_rows``               StatsTable.export_rows: ``window``, ``now``, ``hist``,
                           ``fingerprints`` (only these, with details), ``details_max``
                           (details for every row when there are at most this many)
``hot``                    HotData.export()
``metrics``                the registry's families as data; ``metrics_text``: the exposition
``kill`` ``unpin``         ``client_id`` (this worker's own id), ``disconnect``
``pause`` ``resume``       ``database``, ``wait``
``reload``                 re-read the config file
``console``                a ``pgbouncer`` console statement: ``sql``, ``user``,
                           ``admin``; the answer's wire bytes as latin-1 text
``console_state``          what the console's commands set (PAUSE, DISABLE, SET...)
``instance_state``         paused databases and held breakers (for a restarted worker)
``replaced_state``         ``instance`` (the above) and ``console`` (for a ``--replace``)

Every request carries a ``deadline`` (epoch seconds): a worker that reads it
later (it was stopped or overloaded) drops it instead of acting on it.

Every view is a short synchronous read, as the HTTP handlers are, except
``top_rows`` (yields to the event loop every ``EXPORT_CHUNK`` rows, so a full
statistics table never holds queries up) and ``pause`` (waits for servers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from admin import schemas as s
from scry.adminapi import views
from scry.adminapi.errors import ApiError
from scry.config import ConfigError, load_config
from scry.log import event
from scry.protocol.errors import ADMIN_SHUTDOWN

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from scry.client import ClientConnection
    from scry.observe.metrics import ObserveMetrics
    from scry.proxy import Proxy

__all__ = [
    "EXPORT_CHUNK",
    "answer",
    "export_families",
    "export_metrics",
    "hot",
    "kill",
    "pause",
    "reload",
    "resume",
    "status_summary",
    "top",
    "unpin",
    "view",
]

#: Rows of the statistics table exported between two yields to the event loop.
EXPORT_CHUNK = 500


# --------------------------------------------------------------------------- #
# Reads and actions (the HTTP server of a single process calls these too)
# --------------------------------------------------------------------------- #


def status_summary(proxy: Proxy) -> dict[str, Any]:
    """The observatory's summary; ``anonymize_key_random`` also when the key is
    the instance's own random one (scry.workers shares one across workers)."""
    summary = proxy.observatory.stats_summary()
    key = proxy.identity.instance_key
    if key is not None and proxy.config.observability.anonymize_key == key:
        summary["anonymize_key_random"] = True
    return summary


def top(
    proxy: Proxy, by: str, limit: int, window: float | None, histogram: bool = False
) -> s.TopQueries:
    rows = proxy.observatory.top(by, limit, window, histogram)
    return s.TopQueries.model_validate(
        {"by": by, "window_seconds": window, "limit": limit, "queries": rows}
    )


def hot(proxy: Proxy, limit: int) -> s.HotData:
    return s.HotData.model_validate(proxy.observatory.hot(limit))


def find_client(proxy: Proxy, client_id: str) -> ClientConnection:
    for client in proxy.clients:
        if client.id == client_id:
            return client
    raise ApiError(404, "not_found", f"no client {client_id!r}")


def kill(proxy: Proxy, client_id: str) -> s.KillResult:
    client = find_client(proxy, client_id)
    event("client killed by an administrator", client=client.id, addr=client.addr)
    client.fatal(ADMIN_SHUTDOWN, "terminated by administrator")
    return s.KillResult(client_id=client.id, killed=True)


def unpin(proxy: Proxy, client_id: str, disconnect: bool) -> s.UnpinResult:
    client = find_client(proxy, client_id)
    result = client.force_unpin(disconnect=disconnect)
    return s.UnpinResult(
        client_id=client.id,
        unpinned=bool(result.get("unpinned")),
        replayed=list(result.get("replayed") or ()),  # type: ignore[call-overload]
        lost=list(result.get("lost") or ()),  # type: ignore[call-overload]
        disconnected=bool(result.get("disconnected")),
        reason=result.get("reason"),  # type: ignore[arg-type]
    )


def check_database(proxy: Proxy, database: str | None) -> str | None:
    if database is not None and database not in proxy.targets:
        raise ApiError(404, "not_found", f"no database {database!r}")
    return database


async def pause(proxy: Proxy, database: str | None, wait: float) -> s.PauseResult:
    check_database(proxy, database)
    complete = await proxy.pause(database, wait)
    return s.PauseResult(paused=proxy.paused, database=database, complete=bool(complete))


def resume(proxy: Proxy, database: str | None) -> s.PauseResult:
    check_database(proxy, database)
    proxy.resume(database)
    return s.PauseResult(paused=proxy.paused, database=database, complete=True)


def reload(proxy: Proxy) -> s.ReloadResult:
    path = proxy.config_path
    if path is None:
        raise ApiError(409, "no_config_file", "the proxy was started without a config file")
    try:
        proxy.apply_config(load_config(path))
    except ConfigError as exc:  # (said to the caller, and logged as a SIGHUP's would be)
        event("reload failed; keeping the running config", logging.ERROR, error=str(exc))
        raise ApiError(400, "invalid_config", f"config not reloaded: {exc}") from None
    return s.ReloadResult(reloaded=True, config_path=str(path), databases=sorted(proxy.targets))


# --------------------------------------------------------------------------- #
# Exports (merged by worker 0: scry.adminapi.fleet)
# --------------------------------------------------------------------------- #


def _scraped(proxy: Proxy) -> ObserveMetrics:
    """The metrics, with the pool gauges (installed by the admin server of
    worker 0 when it starts; the other workers get them at their first scrape)."""
    metrics = proxy.observatory.metrics
    metrics.set_pool_stats_provider(lambda: views.pool_gauges(proxy))
    return metrics


def export_metrics(proxy: Proxy) -> list[dict[str, Any]]:
    """This worker's metric families as data (collected now, as a scrape would)."""
    return export_families(_scraped(proxy).registry)


def export_families(registry: CollectorRegistry) -> list[dict[str, Any]]:
    """A registry's metric families as JSON-able data (scry.adminapi.fleet merges them)."""
    return [
        {
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "unit": family.unit,
            "samples": [[x.name, x.labels, x.value] for x in family.samples],
        }
        for family in registry.collect()
    ]


class Encoded(str):
    """A payload already encoded as JSON text (``answer`` sends it as it is)."""


async def _top_rows(proxy: Proxy, request: dict[str, Any], encode: bool) -> Any:
    stats = proxy.observatory.stats
    window = request.get("window")
    wanted = request.get("fingerprints")
    details = wanted is not None or len(stats) <= int(request.get("details_max", 0))
    rows = stats.export_rows(
        window,
        request.get("now"),
        fingerprints=wanted,
        details=details,
        hist=bool(request.get("hist")),
    )
    # A full table is thousands of rows: export (and encode) them a chunk at a
    # time, letting queries through in between.
    exported: list[list[Any]] = []
    texts: list[str] = []
    for row in rows:
        exported.append(row)
        if len(exported) % EXPORT_CHUNK == 0:
            if encode:
                texts.append(_json_items(exported))
                exported = []
            await asyncio.sleep(0)
    meta = {"details": details, "evicted_total_us": stats.evicted_total_us()}
    if not encode:
        return {"rows": exported, **meta}
    if exported:
        texts.append(_json_items(exported))
    return Encoded('{"rows":[' + ",".join(texts) + "]," + json.dumps(meta)[1:])


def _json_items(rows: list[list[Any]]) -> str:
    """Rows as JSON array items (no brackets), to join chunks into one array."""
    return json.dumps(rows, separators=(",", ":"))[1:-1]


def _status(proxy: Proxy, request: dict[str, Any]) -> dict[str, Any]:
    address = proxy.admin.address if proxy.admin is not None else ""
    payload = views.status(proxy, address, status_summary(proxy), proxy.paused)
    return {
        "status": payload.model_dump(mode="json", by_alias=True),
        "summary": proxy.observatory.stats.export_summary(),
        "pools": [list(key) for key in proxy.pools],
    }


def _page(request: dict[str, Any]) -> tuple[int, int]:
    return int(request.get("limit", 100)), int(request.get("offset", 0))


async def console(proxy: Proxy, request: dict[str, Any]) -> str:
    """This worker's own answer to a ``pgbouncer`` console statement (asked by
    the worker a console session is on: scry.pgbouncer.instance), as latin-1
    text of the wire bytes."""
    from scry.pgbouncer.dispatch import AdminConsole

    answer = AdminConsole(
        proxy, str(request["user"]), admin=bool(request["admin"]), local=True
    ).handle_query(str(request["sql"]))
    if not isinstance(answer, bytes):
        answer = await answer
    return answer.decode("latin-1")


#: ``instance_state``'s ``paused`` entry for a PAUSE of every database.
EVERY_DATABASE = "*"


def instance_state(proxy: Proxy) -> dict[str, Any]:
    """What an operator set on this worker at run time, for a worker started
    again (scry.adminapi.rejoin): paused databases, held breakers."""
    return {
        "paused": sorted(EVERY_DATABASE if db is None else db for db in proxy.paused_databases),
        "held_breakers": held_breakers(proxy),
    }


def replaced_state(proxy: Proxy) -> dict[str, Any]:
    """What a ``--replace`` instance takes from this one (scry.peering):
    ``instance`` (instance_state) and, from a pgbouncer.ini, ``console``
    (the console's state)."""
    console = _console_state(proxy) if proxy.config.pgbouncer is not None else None
    return {"instance": instance_state(proxy), "console": console}


def held_breakers(proxy: Proxy) -> list[dict[str, Any]]:
    """The breakers held open by hand here, as peering messages (Peering.apply_breaker)."""
    return [
        proxy.peering.breaker_message(b, b.state, b.open_reason)
        for b in proxy.breakers.values()
        if b.held
    ]


def _console_state(proxy: Proxy) -> dict[str, Any]:
    from scry.pgbouncer.instance import console_state

    return console_state(proxy)


_Handler = Callable[["Proxy", dict[str, Any]], Any]

_VIEWS: dict[str, _Handler] = {
    "status": _status,
    "pools": lambda p, r: views.pools(p),
    "clients": lambda p, r: views.clients(p, *_page(r)),
    "servers": lambda p, r: views.servers(p, *_page(r)),
    "pins": lambda p, r: views.pins(p),
    "breaker": lambda p, r: views.breakers(p),
    "hot": lambda p, r: p.observatory.hot_data.export(),
    "metrics": lambda p, r: export_metrics(p),
    "metrics_text": lambda p, r: _scraped(p).text().decode("utf-8"),
    "kill": lambda p, r: kill(p, str(r["client_id"])),
    "unpin": lambda p, r: unpin(p, str(r["client_id"]), bool(r.get("disconnect"))),
    "pause": lambda p, r: pause(p, r.get("database"), float(r.get("wait", 5.0))),
    "resume": lambda p, r: resume(p, r.get("database")),
    "reload": lambda p, r: reload(p),
    "console": console,
    "console_state": lambda p, r: _console_state(p),
    "instance_state": lambda p, r: instance_state(p),
    "replaced_state": lambda p, r: replaced_state(p),
}


async def view(proxy: Proxy, request: dict[str, Any], *, encode: bool = False) -> Any:
    """The JSON-able answer of this worker to one request (raises ApiError);
    with ``encode``, big payloads may come as ``Encoded`` JSON text."""
    name = str(request.get("view"))
    if name == "top_rows":
        return await _top_rows(proxy, request, encode)
    handler = _VIEWS.get(name)
    if handler is None:
        raise ApiError(400, "bad_request", f"unknown admin view {name!r}")
    result = handler(proxy, request)
    if isinstance(result, Awaitable):
        result = await result
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json", by_alias=True)
    return result


async def answer(proxy: Proxy, request: dict[str, Any]) -> bytes:
    """``view`` as the peering reply: ``{"ok": ...}`` or ``{"error": ...}``.
    A request past its ``deadline`` (epoch seconds) is not carried out: the
    worker that asked has already given up on this one."""
    deadline = request.get("deadline")
    if deadline is not None and time.time() > float(deadline):
        event("admin request from worker 0 arrived too late; dropped", logging.WARNING,
              view=str(request.get("view")))  # fmt: skip
        return b'{"error":{"status":504,"code":"expired","message":"past its deadline"}}'
    try:
        result = await view(proxy, request, encode=True)
        if isinstance(result, Encoded):
            return f'{{"ok":{result}}}'.encode()
        reply: dict[str, Any] = {"ok": result}
    except ApiError as exc:
        reply = {"error": {"status": exc.status, "code": exc.code, "message": exc.message}}
    except (KeyError, TypeError, ValueError) as exc:
        reply = {"error": {"status": 400, "code": "bad_request", "message": repr(exc)}}
    return json.dumps(reply, separators=(",", ":")).encode("utf-8")
