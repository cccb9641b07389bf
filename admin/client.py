"""An async client of the admin API, on httpx, for the console and the CLI.

::

    async with AdminClient("127.0.0.1:6480", token=...) as admin:
        status = await admin.status()
        async for item in admin.tail(min_ms=5):
            if isinstance(item, TailEvent): ...

Errors form one tree::

    AdminError                 anything the client raises
    ├── AdminUnavailable       cannot connect, or the connection broke
    └── AdminHTTPError         the proxy answered with an error (.status, .code)
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from admin.schemas import (
    API_PREFIX,
    BreakerActionResult,
    BreakerList,
    ClientList,
    Health,
    HotData,
    KillResult,
    PauseResult,
    PinList,
    PoolList,
    ReloadResult,
    ServerList,
    Status,
    TailEvent,
    TailNotice,
    TopQueries,
    UnpinResult,
)

DEFAULT_TARGET = "http://127.0.0.1:6480"
TOKEN_ENV = "SCRY_ADMIN_TOKEN"

M = TypeVar("M", bound=BaseModel)


class AdminError(Exception):
    """Base of every error raised by :class:`AdminClient`."""


class AdminUnavailable(AdminError):
    """The admin endpoint could not be reached, or the connection broke."""


class AdminHTTPError(AdminError):
    """The proxy answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def parse_target(target: str | None) -> str:
    """The base URL of a TARGET: ``http(s)://host:port`` or ``host:port`` (None: the default).

    ``ssh://`` targets are opened by the console (it owns the tunnel), not here.
    """
    if not target:
        return DEFAULT_TARGET
    target = target.strip().rstrip("/")
    if target.startswith(("http://", "https://")):
        return target
    if "://" in target:
        scheme = target.split("://", 1)[0]
        raise ValueError(f"unsupported target scheme {scheme!r}: use http://host:port or host:port")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target must be host:port or http://host:port, not {target!r}")
    return f"http://{target}"


class AdminClient:
    """One admin endpoint. Use as an async context manager, or call :meth:`aclose`."""

    def __init__(
        self,
        target: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        verify: bool | str | ssl.SSLContext = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = parse_target(target)
        if isinstance(verify, str):  # a CA file (e.g. the proxy's self-signed certificate)
            verify = ssl.create_default_context(cafile=verify)
        headers = {"Accept": "application/json", "User-Agent": "scry-admin-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            verify=verify,
            transport=transport,
        )

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- plumbing -------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, params: dict[str, Any] | None = None
    ) -> httpx.Response:
        clean = {k: _param_value(v) for k, v in (params or {}).items() if v is not None}
        try:
            response = await self._http.request(method, path, params=clean)
        except httpx.TransportError as exc:
            raise AdminUnavailable(f"{self.base_url}: {exc or type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise _http_error(response)
        return response

    async def _get(self, model: type[M], path: str, **params: Any) -> M:
        response = await self._request("GET", path, params)
        return model.model_validate(response.json())

    async def _post(self, model: type[M], path: str, **params: Any) -> M:
        response = await self._request("POST", path, params)
        return model.model_validate(response.json())

    # --- reads ------------------------------------------------------------------------

    async def healthz(self) -> Health:
        return await self._get(Health, "/healthz")

    async def status(self) -> Status:
        return await self._get(Status, f"{API_PREFIX}/status")

    async def pools(self) -> PoolList:
        return await self._get(PoolList, f"{API_PREFIX}/pools")

    async def clients(self, limit: int = 100, offset: int = 0) -> ClientList:
        return await self._get(ClientList, f"{API_PREFIX}/clients", limit=limit, offset=offset)

    async def servers(self, limit: int = 100, offset: int = 0) -> ServerList:
        return await self._get(ServerList, f"{API_PREFIX}/servers", limit=limit, offset=offset)

    async def pins(self) -> PinList:
        return await self._get(PinList, f"{API_PREFIX}/pins")

    async def breaker(self) -> BreakerList:
        return await self._get(BreakerList, f"{API_PREFIX}/breaker")

    async def top(
        self,
        by: str = "total_time",
        limit: int = 50,
        window: float | None = None,
        histogram: bool = False,
    ) -> TopQueries:
        return await self._get(
            TopQueries,
            f"{API_PREFIX}/queries/top",
            by=by,
            limit=limit,
            window=window,
            histogram=True if histogram else None,  # (None: not sent, as to older proxies)
        )

    async def hot(self, limit: int = 50) -> HotData:
        return await self._get(HotData, f"{API_PREFIX}/hot", limit=limit)

    async def metrics(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def openapi(self) -> dict[str, Any]:
        document: dict[str, Any] = (await self._request("GET", f"{API_PREFIX}/openapi.json")).json()
        return document

    # --- actions ----------------------------------------------------------------------

    async def unpin(self, client_id: str, disconnect: bool = False) -> UnpinResult:
        return await self._post(
            UnpinResult, f"{API_PREFIX}/pins/{client_id}/unpin", disconnect=disconnect
        )

    async def trip(self, database: str | None = None, reason: str | None = None) -> BreakerActionResult:  # fmt: skip
        return await self._post(
            BreakerActionResult, f"{API_PREFIX}/breaker/trip", database=database, reason=reason
        )

    async def reset(self, database: str | None = None) -> BreakerActionResult:
        return await self._post(BreakerActionResult, f"{API_PREFIX}/breaker/reset", database=database)  # fmt: skip

    async def kill(self, client_id: str) -> KillResult:
        return await self._post(KillResult, f"{API_PREFIX}/clients/{client_id}/kill")

    async def pause(self) -> PauseResult:
        return await self._post(PauseResult, f"{API_PREFIX}/pause")

    async def resume(self) -> PauseResult:
        return await self._post(PauseResult, f"{API_PREFIX}/resume")

    async def reload(self) -> ReloadResult:
        return await self._post(ReloadResult, f"{API_PREFIX}/reload")

    # --- the live tail ----------------------------------------------------------------

    async def tail(
        self,
        *,
        fingerprint: str | None = None,
        min_ms: float | None = None,
        errors: bool = False,
        database: str | None = None,
        client_id: str | None = None,
    ) -> AsyncIterator[TailEvent | TailNotice]:
        """Stream events (NDJSON) until the proxy closes the stream.

        Yields :class:`TailEvent` per query and :class:`TailNotice` for
        heartbeats (about one a second when idle) and drops. Raises
        :class:`AdminUnavailable` when the connection cannot be made or
        breaks; the caller decides whether to reconnect.
        """
        params = {
            "fingerprint": fingerprint,
            "min_ms": min_ms,
            "errors": True if errors else None,
            "database": database,
            "client_id": client_id,
        }
        clean = {k: _param_value(v) for k, v in params.items() if v is not None}
        # No read timeout: the stream is idle between heartbeats only briefly,
        # but a read timeout would turn a quiet proxy into an error.
        timeout = httpx.Timeout(self._http.timeout.connect or 5.0, read=30.0)
        try:
            async with self._http.stream(
                "GET",
                f"{API_PREFIX}/tail",
                params=clean,
                headers={"Accept": "application/x-ndjson"},
                timeout=timeout,
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _http_error(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    data = json.loads(line)
                    if data.get("type") == "query":
                        yield TailEvent.model_validate(data)
                    else:
                        yield TailNotice.model_validate(data)
        except httpx.TransportError as exc:
            raise AdminUnavailable(f"{self.base_url}: {exc or type(exc).__name__}") from exc


def _param_value(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _http_error(response: httpx.Response) -> AdminHTTPError:
    try:
        body = response.json()
        return AdminHTTPError(response.status_code, str(body["code"]), str(body["message"]))
    except (ValueError, KeyError, TypeError):
        return AdminHTTPError(response.status_code, "http_error", response.text[:200])
