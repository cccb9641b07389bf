"""The admin HTTP server: aiohttp, embedded in the proxy's event loop.

``AdminServer(proxy)`` serves ``/healthz``, ``/metrics``, ``/debug/hot_data``
and ``/api/v1/*`` (docs/admin-api.md) on ``admin.listen_addr``, optionally
over TLS. Responses are the pydantic models of ``admin.schemas``, and the
OpenAPI document is generated from the same models.

Staying out of the query path's way:

* every handler is a short synchronous read of counters and the pools'
  own structures; only the listings walk all connections, and the big
  ones are paginated;
* the live tail reads from an ``Observatory`` subscription, a bounded
  buffer that drops its oldest event (counted) for a slow reader: the
  pipeline never waits for an HTTP client, and writes to a reader that
  stops reading for ``TAIL_WRITE_TIMEOUT`` end its stream;
* no access log (a line per poll would cost more than the poll).

With several workers (``scry serve --workers N``) only worker 0 runs this
server, and every read and action answers for the whole instance: the
workers are asked over their peering sockets and their answers merged
(scry.adminapi.instance); ``?worker=N`` answers for one worker. With one
worker nothing of that runs.

Authorization (``admin.token``, compared with ``hmac.compare_digest``):
``/healthz`` is always open; ``/metrics`` is open with
``admin.metrics_public``; any other read needs the token when one is
configured; actions (POST) always need it, and answer 403 under
``admin.read_only`` or when no token is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Union

from aiohttp import web
from pydantic import BaseModel

from admin import schemas as s
from scry import __version__
from scry.adminapi import local, views
from scry.adminapi.errors import ApiError
from scry.adminapi.instance import Instance, Scope
from scry.adminapi.tail import (
    TAIL_BATCH,
    TAIL_BUFFER,
    TAIL_HEARTBEAT,
    TAIL_WRITE_TIMEOUT,
    FleetTail,
)
from scry.config import is_loopback_host, split_host_port
from scry.log import event

if TYPE_CHECKING:
    from scry.observe.events import Subscription
    from scry.proxy import Proxy

log = logging.getLogger("scry.admin")

P = s.API_PREFIX
SUMMARY_TTL = 0.5  # seconds a stats summary is reused between status polls
DEFAULT_PAGE = 100
MAX_PAGE = 1000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TailSource = Union["Subscription", FleetTail]

__all__ = ["AdminServer", "ApiError"]


def _model_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        body=model.model_dump_json(by_alias=True).encode("utf-8"),
        status=status,
        content_type="application/json",
    )


def _error_response(status: int, code: str, message: str) -> web.Response:
    response = _model_response(s.ErrorResponse(code=code, message=message), status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="scry"'
    return response


# --- query parameters ----------------------------------------------------------------


_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if _INTEGER.fullmatch(raw) is None:  # (int() also takes "1_0" and other scripts' digits)
        raise ApiError(400, "bad_parameter", f"{name} must be an integer, not {raw!r}")
    value = int(raw)
    if not low <= value <= high:
        raise ApiError(400, "bad_parameter", f"{name} must be between {low} and {high}")
    return value


def _float_param(
    request: web.Request, name: str, low: float, high: float, exclusive_low: bool = False
) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    if _NUMBER.fullmatch(raw) is None:  # (float() also takes "1_0", "inf", "nan" ...)
        raise ApiError(400, "bad_parameter", f"{name} must be a number, not {raw!r}")
    value = float(raw)
    if value != value or value > high or value < low or (exclusive_low and value == low):
        raise ApiError(400, "bad_parameter", f"{name} must be a number in ({low}, {high}]")
    return value


def _bool_param(request: web.Request, name: str) -> bool:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return False
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ApiError(400, "bad_parameter", f"{name} must be true or false, not {raw!r}")


def _page(request: web.Request) -> tuple[int, int]:
    limit = _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    offset = _int_param(request, "offset", 0, 0, 2**31 - 1)
    return limit, offset


# --- the server -----------------------------------------------------------------------


class _OneLineHttpErrors(logging.Filter):
    """aiohttp's log of a request it could not handle, as one line without the
    exception: a malformed request's text (its Authorization header with a
    real token in it, say) must not reach the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        record.msg = "admin API: a request could not be handled: %s"
        record.args = (type(error).__name__ if error is not None else "unknown error",)
        record.exc_info = record.exc_text = None
        record.stack_info = None
        return True


_HTTP_ERRORS = logging.getLogger("scry.adminapi.http")
_HTTP_ERRORS.addFilter(_OneLineHttpErrors())


class AdminServer:
    """The admin API of one proxy (one per event loop)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.runner: web.AppRunner | None = None
        self.address = ""  # host:port actually bound (port 0 picks a free one)
        self.port = 0
        # Bound beyond loopback: every request needs the token, whatever a
        # reload says (the listener stays where it was bound until a restart).
        self.exposed = False
        self.tls = False
        # Several workers: worker 0 answers for all of them (None: a single process).
        self.instance = Instance(proxy) if proxy.identity.workers > 1 else None
        self._tails: set[TailSource] = set()
        self._summary: tuple[float, dict[str, Any]] | None = None
        self._openapi: bytes | None = None

    # --- lifecycle ------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024)
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/debug/hot_data", self.hot)
        r.add_get(f"{P}/openapi.json", self.openapi)
        r.add_get(f"{P}/status", self.status)
        r.add_get(f"{P}/pools", self.pools)
        r.add_get(f"{P}/clients", self.clients)
        r.add_post(f"{P}/clients/{{client_id}}/kill", self.kill)
        r.add_get(f"{P}/servers", self.servers)
        r.add_get(f"{P}/pins", self.pins)
        r.add_post(f"{P}/pins/{{client_id}}/unpin", self.unpin)
        r.add_get(f"{P}/breaker", self.breaker)
        r.add_post(f"{P}/breaker/trip", self.breaker_trip)
        r.add_post(f"{P}/breaker/reset", self.breaker_reset)
        r.add_get(f"{P}/queries/top", self.top)
        r.add_get(f"{P}/hot", self.hot)
        r.add_get(f"{P}/tail", self.tail)
        r.add_post(f"{P}/pause", self.pause)
        r.add_post(f"{P}/resume", self.resume)
        r.add_post(f"{P}/reload", self.reload)
        return app

    async def start(self) -> None:
        """Bind ``admin.listen_addr``; raises OSError (or ssl.SSLError) if it cannot."""
        cfg = self.proxy.config.admin
        host, port = split_host_port(cfg.listen_addr)
        context = None
        if cfg.tls_cert_file and cfg.tls_key_file:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
            self.tls = True
        runner = web.AppRunner(
            self.build_app(),
            access_log=None,
            logger=_HTTP_ERRORS,  # (aiohttp's own would log a bad request's headers)
            handle_signals=False,
            handler_cancellation=True,  # a tail whose reader left stops at once
            shutdown_timeout=1.0,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=context, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        bound = runner.addresses[0] if runner.addresses else (host, port)
        self.port = int(bound[1])
        self.address = views._sockname((bound[0], bound[1]))
        self.exposed = not is_loopback_host(str(bound[0]))
        self.proxy.observatory.metrics.set_pool_stats_provider(
            lambda: views.pool_gauges(self.proxy)
        )
        event("admin API listening", addr=self.address, tls=self.tls,
              token=bool(cfg.token), read_only=cfg.read_only)  # fmt: skip

    async def stop(self) -> None:
        """End the tails and close the listener (in-flight requests get 1 s)."""
        for subscription in list(self._tails):
            subscription.close()
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()
        self.proxy.observatory.metrics.set_pool_stats_provider(None)

    # --- authorization and errors ----------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self._authorize(request)
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc.status, exc.code, exc.message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
                exc.status, "http_error"
            )
            return _error_response(exc.status, code, exc.reason)
        except (asyncio.CancelledError, ConnectionError):
            raise  # the peer left: nothing to answer
        except Exception as exc:
            log.exception("admin request failed: %s %s", request.method, request.path)
            return _error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")

    def _authorize(self, request: web.Request) -> None:
        cfg = self.proxy.config.admin  # read per request: a reload can rotate the token
        path = request.path
        if path == "/healthz":
            return
        action = request.method == "POST"
        token = cfg.token
        if (action or self.exposed) and not token:
            what = "actions need" if action else f"the admin API on {self.address} needs"
            raise ApiError(
                403, "token_required", f"{what} admin.token (or admin.token_file) configured"
            )
        if not token or (path == "/metrics" and cfg.metrics_public and not action):
            return
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise ApiError(401, "unauthorized", "missing token: send Authorization: Bearer <token>")
        # (surrogateescape: a header's non-UTF-8 bytes are a wrong token, not an error)
        given = presented.strip().encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, token.encode()):
            raise ApiError(401, "unauthorized", "wrong token")
        if action and cfg.read_only:
            raise ApiError(403, "read_only", "the admin API is read-only (admin.read_only: true)")

    def _scope(self, request: web.Request) -> Scope | None:
        """The workers to answer for: None when this process is the whole instance
        (one worker: answer directly, as always); else all, or ``?worker=N``."""
        workers = self.proxy.identity.workers
        worker = None
        if request.query.get("worker", "") != "":
            worker = _int_param(request, "worker", 0, 0, workers - 1)
        return None if self.instance is None else self.instance.scope(worker)

    # --- reads ------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return _model_response(s.Health(draining=self.proxy.draining))

    async def metrics(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            body = await self.instance.metrics(scope)
        else:
            body = self.proxy.observatory.metrics.text()
        response = web.Response(body=body)
        response.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return response

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = json.dumps(s.openapi_document(__version__)).encode("utf-8")
        return web.Response(body=self._openapi, content_type="application/json")

    def _stats_summary(self) -> dict[str, Any]:
        now = time.monotonic()
        cached = self._summary
        if cached is not None and now - cached[0] < SUMMARY_TTL:
            return cached[1]
        summary = local.status_summary(self.proxy)
        self._summary = (now, summary)
        return summary

    async def status(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.status(scope))
        return _model_response(
            views.status(self.proxy, self.address, self._stats_summary(), self._paused())
        )

    async def pools(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.pools(scope))
        return _model_response(views.pools(self.proxy))

    async def clients(self, request: web.Request) -> web.Response:
        limit, offset = _page(request)
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.clients(scope, limit, offset))
        return _model_response(views.clients(self.proxy, limit, offset))

    async def servers(self, request: web.Request) -> web.Response:
        limit, offset = _page(request)
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.servers(scope, limit, offset))
        return _model_response(views.servers(self.proxy, limit, offset))

    async def pins(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.pins(scope))
        return _model_response(views.pins(self.proxy))

    async def breaker(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.breaker(scope))
        return _model_response(views.breakers(self.proxy))

    async def top(self, request: web.Request) -> web.Response:
        by = request.query.get("by") or "total_time"
        if by not in s.RANKINGS:
            raise ApiError(400, "bad_parameter", f"by must be one of {', '.join(s.RANKINGS)}")
        limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
        window = _float_param(request, "window", 0.0, 86400.0, exclusive_low=True)
        histogram = _bool_param(request, "histogram")
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.top(scope, by, limit, window, histogram))
        return _model_response(local.top(self.proxy, by, limit, window, histogram))

    async def hot(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            return _model_response(await self.instance.hot(scope, limit))
        return _model_response(local.hot(self.proxy, limit))

    # --- the live tail ----------------------------------------------------------------

    async def tail(self, request: web.Request) -> web.StreamResponse:
        wanted: dict[str, Any] = {}
        fingerprint = request.query.get("fingerprint")
        if fingerprint:
            wanted["fingerprint"] = fingerprint
        for name in ("database", "client_id"):
            if request.query.get(name):
                wanted[name] = request.query[name]
        min_ms = _float_param(request, "min_ms", 0.0, 1e9)
        if min_ms:
            wanted["min_total_us"] = int(min_ms * 1000)
        if _bool_param(request, "errors"):
            wanted["errors_only"] = True
        sse = "text/event-stream" in request.headers.get("Accept", "")
        scope = self._scope(request)
        subscription: TailSource
        if scope is not None and self.instance is not None:
            subscription = self.instance.tail(scope, wanted)  # before answering: may refuse
        else:
            subscription = self.proxy.observatory.subscribe(wanted, maxsize=TAIL_BUFFER)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream" if sse else "application/x-ndjson",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        self._tails.add(subscription)
        reported = 0
        try:
            await response.prepare(request)
            while not subscription.closed:
                try:
                    first = await asyncio.wait_for(subscription.get(), TAIL_HEARTBEAT)
                except TimeoutError:
                    await self._write(request, response, [_notice("heartbeat", subscription)], sse)
                    continue
                except asyncio.CancelledError:
                    if subscription.closed:
                        break  # the observatory or the admin server is stopping
                    raise
                items: list[dict[str, Any]] = []
                if subscription.dropped != reported:
                    reported = subscription.dropped
                    items.append(_notice("dropped", subscription))
                items.append({"type": "query", **first})
                while len(items) < TAIL_BATCH and not subscription.empty():
                    items.append({"type": "query", **subscription.get_nowait()})
                await self._write(request, response, items, sse)
        except (ConnectionError, TimeoutError):
            pass  # the reader left, or stopped reading
        finally:
            subscription.close()
            self._tails.discard(subscription)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response

    async def _write(
        self,
        request: web.Request,
        response: web.StreamResponse,
        items: list[dict[str, Any]],
        sse: bool,
    ) -> None:
        if sse:
            chunk = "".join(
                f"event: {item['type']}\ndata: {json.dumps(item, separators=(',', ':'))}\n\n"
                for item in items
            )
        else:
            chunk = "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in items)
        try:
            await asyncio.wait_for(response.write(chunk.encode("utf-8")), TAIL_WRITE_TIMEOUT)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise

    # --- actions ----------------------------------------------------------------------

    async def kill(self, request: web.Request) -> web.Response:
        client_id = request.match_info["client_id"]
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            result = await self.instance.act_on_client("kill", client_id, scope)
            return _model_response(s.KillResult.model_validate(result))
        return _model_response(local.kill(self.proxy, client_id))

    async def unpin(self, request: web.Request) -> web.Response:
        disconnect = _bool_param(request, "disconnect")
        client_id = request.match_info["client_id"]
        scope = self._scope(request)
        if scope is not None and self.instance is not None:
            result = await self.instance.act_on_client(
                "unpin", client_id, scope, disconnect=disconnect
            )
            return _model_response(s.UnpinResult.model_validate(result))
        return _model_response(local.unpin(self.proxy, client_id, disconnect))

    def _breaker_targets(self, request: web.Request) -> list[str]:
        known = views.breaker_databases(self.proxy)
        database = request.query.get("database")
        if not database:
            return known
        if database not in known:
            raise ApiError(404, "not_found", f"no database {database!r}")
        return [database]

    async def breaker_trip(self, request: web.Request) -> web.Response:
        names = self._breaker_targets(request)
        reason = (request.query.get("reason") or "").strip()[:200] or "tripped via the admin API"
        changed = [n for n in names if self.proxy.breaker_for(n).trip(reason, hold=True)]
        return self._breaker_result("trip", changed, names)

    async def breaker_reset(self, request: web.Request) -> web.Response:
        names = self._breaker_targets(request)
        changed = [n for n in names if self.proxy.breaker_for(n).reset("reset via the admin API")]
        return self._breaker_result("reset", changed, names)

    def _breaker_result(self, action: str, changed: list[str], names: list[str]) -> web.Response:
        return _model_response(
            s.BreakerActionResult.model_validate(
                {
                    "action": action,
                    "changed": changed,
                    "databases": [views.breaker_entry(self.proxy, n) for n in names],
                }
            )
        )

    async def pause(self, request: web.Request) -> web.Response:
        database = local.check_database(self.proxy, request.query.get("database") or None)
        wait = _float_param(request, "wait", 0.0, 60.0)
        wait = 5.0 if wait is None else wait
        if self.instance is not None:
            return _model_response(await self.instance.pause(database, wait))
        return _model_response(await local.pause(self.proxy, database, wait))

    async def resume(self, request: web.Request) -> web.Response:
        database = local.check_database(self.proxy, request.query.get("database") or None)
        if self.instance is not None:
            return _model_response(await self.instance.resume(database))
        return _model_response(local.resume(self.proxy, database))

    def _paused(self) -> bool:
        return bool(getattr(self.proxy, "paused", False))

    async def reload(self, request: web.Request) -> web.Response:
        if self.instance is not None:
            return _model_response(await self.instance.reload())
        return _model_response(local.reload(self.proxy))


def _notice(kind: str, subscription: TailSource) -> dict[str, Any]:
    notice = {"type": kind, "ts": time.time(), "dropped": subscription.dropped}
    if isinstance(subscription, FleetTail):
        notice["missing"] = [
            {"worker": w, "error": e} for w, e in sorted(subscription.missing.items())
        ]
    return notice
