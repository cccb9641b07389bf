"""Worker 0's view of its instance: ask the workers, merge their answers.

With ``workers: N`` only worker 0 serves the admin API. For a request it
asks every worker in scope concurrently, over their peering sockets
(``{"op": "admin", "view": ...}``, see scry.adminapi.local), answers for
itself in-process, and merges (scry.adminapi.fleet). Each worker gets
``timeout`` (1 s) to answer; one that is slow, stopped or gone is left out
and named in the answer's ``fleet.missing``, so a sick worker never hangs
the API. ``?worker=N`` scopes a request to one worker.

Costs: one Unix-socket round trip per worker and request (two for a clients
or servers page, and for a ranking whose rows must be fetched in detail);
the workers read what a single process's handlers read. Rankings fetch
every fingerprint's sums (numbers only) and texts and histograms only for
the rows shown, unless a worker has few fingerprints (``DETAILS_MAX``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from admin import schemas as s
from scry.adminapi import fleet, local
from scry.adminapi.errors import ApiError
from scry.adminapi.tail import FleetTail
from scry.observe.sketch import merge_hot
from scry.observe.stats import merge_rows, merge_summaries, merged_total_us, rank_merged

if TYPE_CHECKING:
    from scry.proxy import Proxy

__all__ = ["WORKER_TIMEOUT", "Gathered", "Instance", "Scope"]

#: Seconds each worker gets to answer one request.
WORKER_TIMEOUT = 1.0
#: A worker with at most this many fingerprints sends their details at once.
DETAILS_MAX = 200
#: Exported rows above which worker 0 merges a ranking in a thread (off its loop).
THREAD_MERGE_ROWS = 2_000
#: Seconds a merged status is reused between polls.
STATUS_TTL = 0.5


@dataclass(frozen=True)
class Scope:
    """The workers a request covers: all of them, or one (``?worker=N``)."""

    workers: tuple[int, ...]
    instance: bool


@dataclass
class Gathered:
    """What the workers answered: payloads, error answers, and who did not answer."""

    answers: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, ApiError] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)

    def update(self, other: Gathered) -> None:
        self.errors.update(other.errors)
        self.missing.update(other.missing)


class Instance:
    """The admin API's access to every worker of this proxy's instance."""

    def __init__(self, proxy: Proxy, timeout: float = WORKER_TIMEOUT) -> None:
        self.proxy = proxy
        self.workers = proxy.identity.workers
        self.timeout = timeout
        self._status: dict[Scope, tuple[float, s.Status]] = {}

    def scope(self, worker: int | None) -> Scope:
        if worker is None:
            return Scope(tuple(range(self.workers)), True)
        return Scope((worker,), False)

    def socket_path(self, worker: int) -> Path:
        directory = self.proxy.peering.dir
        if directory is None:
            raise OSError("this worker has no peering directory")
        return directory / f"w{worker}.sock"

    # --- asking ---------------------------------------------------------------------

    async def ask(self, worker: int, request: dict[str, Any], timeout: float) -> Any:
        """One worker's answer to a request (this worker's own, in-process)."""
        if worker == self.proxy.worker_id:
            return await local.view(self.proxy, request)
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(str(self.socket_path(worker)))
                # A worker that wakes up late (stopped, overloaded) must not act on
                # a request worker 0 already answered as failed: it drops it.
                message = {"op": "admin", **request, "deadline": time.time() + timeout}
                writer.write(b"J" + json.dumps(message, separators=(",", ":")).encode() + b"\n")
                await writer.drain()
                data = await reader.read()
        finally:
            if writer is not None:
                writer.close()
        reply = json.loads(data)
        error = reply.get("error")
        if error is not None:
            raise ApiError(int(error["status"]), str(error["code"]), str(error["message"]))
        return reply["ok"]

    async def gather(
        self, requests: dict[int, dict[str, Any]], timeout: float | None = None
    ) -> Gathered:
        """Ask each worker its request concurrently; never waits past the timeout."""
        limit = self.timeout if timeout is None else timeout
        workers = list(requests)
        results = await asyncio.gather(
            *(self.ask(w, requests[w], limit) for w in workers), return_exceptions=True
        )
        gathered = Gathered()
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, TimeoutError) or getattr(result, "code", "") == "expired":
                gathered.missing[worker] = f"timeout ({limit:g} s)"
            elif isinstance(result, ApiError):
                gathered.errors[worker] = result
            elif isinstance(result, OSError):
                gathered.missing[worker] = f"unreachable: {result.strerror or result}"
            elif isinstance(result, ValueError | KeyError):
                gathered.missing[worker] = f"bad answer: {result!r}"
            elif isinstance(result, BaseException):
                raise result
            else:
                gathered.answers[worker] = result
        return gathered

    async def gather_all(
        self, scope: Scope, request: dict[str, Any], timeout: float | None = None
    ) -> Gathered:
        """``gather`` one request from every worker of the scope; at least one
        must answer (else 503), and a worker's error answer is raised."""
        gathered = await self.gather({w: request for w in scope.workers}, timeout)
        _raise_errors(gathered)
        return gathered

    def fleet_info(self, scope: Scope, gathered: Gathered) -> s.FleetInfo:
        return s.FleetInfo(
            scope="instance" if scope.instance else "worker",
            workers=self.workers,
            answered=sorted(gathered.answers),
            missing=[
                s.WorkerMissing(worker=w, error=e) for w, e in sorted(gathered.missing.items())
            ],
        )

    # --- reads ------------------------------------------------------------------------

    async def status(self, scope: Scope) -> s.Status:
        now = time.monotonic()
        cached = self._status.get(scope)
        if cached is not None and now - cached[0] < STATUS_TTL:
            return cached[1]
        g = await self.gather_all(scope, {"view": "status"})
        if scope.instance:
            queries = merge_summaries([a["summary"] for a in g.answers.values()])
            payload = fleet.merge_status(g.answers, queries, self.proxy.identity.instance)
        else:
            payload = next(iter(g.answers.values()))["status"]
        status = s.Status.model_validate({**payload, "fleet": self.fleet_info(scope, g)})
        self._status[scope] = (now, status)
        return status

    async def pools(self, scope: Scope) -> s.PoolList:
        g = await self.gather_all(scope, {"view": "pools"})
        payload = fleet.merge_pools(g.answers)
        return s.PoolList.model_validate({**payload, "fleet": self.fleet_info(scope, g)})

    async def pins(self, scope: Scope) -> s.PinList:
        g = await self.gather_all(scope, {"view": "pins"})
        payload = fleet.merge_pins(g.answers)
        return s.PinList.model_validate({**payload, "fleet": self.fleet_info(scope, g)})

    async def breaker(self, scope: Scope) -> s.BreakerList:
        g = await self.gather_all(scope, {"view": "breaker"})
        if scope.instance:
            payload = fleet.merge_breakers(g.answers)
        else:
            payload = next(iter(g.answers.values()))
        return s.BreakerList.model_validate({**payload, "fleet": self.fleet_info(scope, g)})

    async def listing(self, kind: str, scope: Scope, limit: int, offset: int) -> dict[str, Any]:
        """A clients or servers page. One worker: its page. Several: their
        totals first, then the slices that make up the page (``fleet.page_plan``)."""
        if len(scope.workers) == 1:
            g = await self.gather_all(scope, {"view": kind, "limit": limit, "offset": offset})
            total = sum(int(a["total"]) for a in g.answers.values())
            payload = fleet.merge_listing(kind, g.answers, total, limit, offset)
            return {**payload, "fleet": self.fleet_info(scope, g)}
        g = await self.gather_all(scope, {"view": kind, "limit": 0, "offset": 0})
        totals = {w: int(a["total"]) for w, a in g.answers.items()}
        plan = fleet.page_plan(totals, limit, offset)
        pages = await self.gather(
            {w: {"view": kind, "limit": n, "offset": o} for w, (n, o) in plan.items()}
        )
        if pages.errors:
            raise pages.errors[min(pages.errors)]
        g.update(pages)
        for worker in pages.missing:
            g.answers.pop(worker, None)
            totals.pop(worker, None)
        payload = fleet.merge_listing(kind, pages.answers, sum(totals.values()), limit, offset)
        return {**payload, "fleet": self.fleet_info(scope, g)}

    async def clients(self, scope: Scope, limit: int, offset: int) -> s.ClientList:
        return s.ClientList.model_validate(await self.listing("clients", scope, limit, offset))

    async def servers(self, scope: Scope, limit: int, offset: int) -> s.ServerList:
        return s.ServerList.model_validate(await self.listing("servers", scope, limit, offset))

    async def hot(self, scope: Scope, limit: int) -> s.HotData:
        g = await self.gather_all(scope, {"view": "hot"})
        payload = merge_hot(list(g.answers.values()), limit)
        return s.HotData.model_validate({**payload, "fleet": self.fleet_info(scope, g)})

    async def top(
        self, scope: Scope, by: str, limit: int, window: float | None, histogram: bool = False
    ) -> s.TopQueries:
        """The ranking over the workers' merged statistics (``histogram``: with
        each row's merged latency histogram).

        Round 1: every fingerprint's sums (histograms too when ranking by p99)
        from each worker, merged and ranked. Round 2, only if some worker had
        too many fingerprints to send their details: texts and histograms of
        the ranked rows, from those workers. Both rounds read the same window
        (``now`` is worker 0's)."""
        now = time.time()
        request = {"view": "top_rows", "window": window, "now": now, "hist": by == "p99"}
        g = await self.gather_all(scope, {**request, "details_max": max(limit, DETAILS_MAX)})
        evicted = 0
        if window is None:  # the evicted fingerprints' time is part of the cumulative total
            evicted = sum(int(a["evicted_total_us"]) for a in g.answers.values())
        parts = [a["rows"] for a in g.answers.values()]
        rows, grand_total = await self._rank(parts, by, limit, evicted, histogram)
        brief = [w for w, a in g.answers.items() if not a["details"]]
        if brief:
            chosen = [row["fingerprint"] for row in rows]
            details = await self.gather({w: {**request, "fingerprints": chosen} for w in brief})
            if details.errors:
                raise details.errors[min(details.errors)]
            g.update(details)
            for worker in details.missing:
                g.answers.pop(worker, None)
            wanted = set(chosen)
            parts = [a["rows"] for a in details.answers.values()]
            parts += [
                [row for row in a["rows"] if row[0] in wanted]
                for a in g.answers.values()
                if a["details"]
            ]
            rows = rank_merged(merge_rows(parts), by, limit, grand_total, histogram)
        return s.TopQueries.model_validate(
            {
                "by": by,
                "window_seconds": window,
                "limit": limit,
                "queries": rows,
                "fleet": self.fleet_info(scope, g),
            }
        )

    async def _rank(
        self, parts: list[list[list[Any]]], by: str, limit: int, evicted_us: int, histogram: bool
    ) -> tuple[list[dict[str, Any]], int]:
        """Merge exported rows and rank them; also the grand total (µs) of ``share``."""

        def rank() -> tuple[list[dict[str, Any]], int]:
            merged = merge_rows(parts)
            grand_total = merged_total_us(merged) + evicted_us
            return rank_merged(merged, by, limit, grand_total, histogram), grand_total

        if sum(map(len, parts)) > THREAD_MERGE_ROWS:
            # Many fingerprints: merge off the event loop (the GIL is released to
            # the loop every few milliseconds, instead of one long stall).
            return await asyncio.to_thread(rank)
        return rank()

    async def metrics(self, scope: Scope) -> bytes:
        """Prometheus text: the merged families, or one worker's own exposition."""
        if not scope.instance:
            g = await self.gather_all(scope, {"view": "metrics_text"})
            return str(next(iter(g.answers.values()))).encode("utf-8")
        g = await self.gather_all(scope, {"view": "metrics"})
        return fleet.render_metrics(fleet.merge_metrics(g.answers, self.workers))

    def tail(self, scope: Scope, wanted: dict[str, Any]) -> FleetTail:
        client_id = wanted.get("client_id")
        workers = scope.workers
        if client_id:
            worker, raw = self.owner(client_id, scope)
            wanted = {**wanted, "client_id": raw}
            workers = (worker,)
        return FleetTail(self, workers, wanted)

    # --- actions ----------------------------------------------------------------------

    def owner(self, client_id: str, scope: Scope) -> tuple[int, str]:
        """The worker and the worker's own id of a client id (``w1.c12``, or a
        plain id with ``?worker=N``)."""
        worker, raw = fleet.parse_id(client_id)
        if worker is None:
            if scope.instance:
                raise ApiError(
                    400,
                    "bad_parameter",
                    f"with {self.workers} workers a client id names its worker: "
                    f"w<N>.{client_id} (as /api/v1/clients lists them), or pass ?worker=N",
                )
            worker = scope.workers[0]
        elif not scope.instance and worker != scope.workers[0]:
            raise ApiError(
                400, "bad_parameter", f"{client_id} is not a client of worker {scope.workers[0]}"
            )
        if not 0 <= worker < self.workers:
            raise ApiError(404, "not_found", f"no client {client_id!r} (no worker {worker})")
        return worker, raw

    async def act_on_client(
        self, view: str, client_id: str, scope: Scope, **params: Any
    ) -> dict[str, Any]:
        """Kill or unpin a client on the worker that owns it."""
        worker, raw = self.owner(client_id, scope)
        g = await self.gather_all(self.scope(worker), {"view": view, "client_id": raw, **params})
        result: dict[str, Any] = g.answers[worker]
        result.update(client_id=fleet.qualify(worker, result["client_id"]), worker=worker)
        return result

    async def pause(self, database: str | None, wait: float) -> s.PauseResult:
        scope = self.scope(None)
        request = {"view": "pause", "database": database, "wait": wait}
        g = await self.gather_all(scope, request, timeout=wait + self.timeout)
        results = list(g.answers.values())
        return s.PauseResult(
            paused=any(r["paused"] for r in results),
            database=database,
            complete=all(r["complete"] for r in results) and not g.missing,
            fleet=self.fleet_info(scope, g),
        )

    async def resume(self, database: str | None) -> s.PauseResult:
        scope = self.scope(None)
        g = await self.gather_all(scope, {"view": "resume", "database": database})
        return s.PauseResult(
            paused=any(r["paused"] for r in g.answers.values()),
            database=database,
            complete=True,
            fleet=self.fleet_info(scope, g),
        )

    async def reload(self) -> s.ReloadResult:
        """Validate the file here first (an invalid one changes nothing anywhere),
        then every worker reloads it."""
        own = local.reload(self.proxy)
        scope = self.scope(None)
        others = {w: {"view": "reload"} for w in scope.workers if w != self.proxy.worker_id}
        g = await self.gather(others)
        _raise_errors(g)
        g.answers[self.proxy.worker_id] = own.model_dump(mode="json")
        return own.model_copy(update={"fleet": self.fleet_info(scope, g)})


def _raise_errors(gathered: Gathered) -> None:
    if gathered.errors:
        raise gathered.errors[min(gathered.errors)]
    if not gathered.answers and gathered.missing:
        raise _unavailable(gathered)


def _unavailable(gathered: Gathered) -> ApiError:
    named = ", ".join(f"worker {w}: {e}" for w, e in sorted(gathered.missing.items()))
    return ApiError(503, "workers_unavailable", f"no worker answered ({named})")
