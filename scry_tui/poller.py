"""One poller per proxy: fetch, publish, re-arm; back off while it is down.

Dolphie's shape: a poll is re-armed only after the previous one finished, so
a slow proxy never piles up requests, and the UI never waits for it (the
poller runs as its own task and publishes a :class:`ProxyState`). A failure
marks the proxy "unreachable since ..." and retries with exponential backoff
(1 s, 2 s, 4 s ... up to ``MAX_BACKOFF``); the first success clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from admin import AdminClient, AdminError, AdminHTTPError, AdminUnavailable
from scry_tui.model import ProxyState

MAX_BACKOFF = 30.0
FIRST_BACKOFF = 1.0

#: What each view needs from a proxy (``status`` is always fetched: it is the liveness probe).
TOPICS_BY_VIEW: dict[str, tuple[str, ...]] = {
    "fleet": ("pools", "breaker"),
    "top": ("top",),
    "tail": (),
    "pools": ("pools", "clients", "servers"),
    "pins": ("pins",),
    "breaker": ("breaker",),
    "hot": ("hot",),
}


class Clock(Protocol):
    """Wall and monotonic time; tests pass a frozen one so screenshots are stable."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class PollSettings:
    """Shared by every poller of the app; the app changes it in place."""

    interval: float = 2.0
    paused: bool = False
    top_by: str = "total_time"
    top_shown: int = 50  # rows of the Top view
    top_limit: int = 50  # rows asked of each proxy (scry_tui.model.top_fetch_limit)
    top_histograms: bool = False  # (for merging several proxies' percentiles)
    hot_limit: int = 50


class Poller:
    """Polls one proxy's admin API for the topics the visible view needs."""

    def __init__(
        self,
        client: AdminClient,
        state: ProxyState,
        settings: PollSettings,
        on_update: Callable[[ProxyState], None],
        clock: Clock | None = None,
    ) -> None:
        self.client = client
        self.state = state
        self.settings = settings
        self.on_update = on_update
        self.clock = clock or SystemClock()
        self.topics: set[str] = {"pools", "breaker"}
        self._wake = asyncio.Event()
        self._backoff = 0.0
        self.polling = False

    def want(self, topics: Iterable[str]) -> None:
        """Poll these topics (besides status) from now on, starting right away."""
        self.topics = set(topics)
        self.wake()

    def wake(self) -> None:
        """Poll now instead of at the end of the current wait (paused or not)."""
        self._wake.set()

    async def poll_once(self) -> bool:
        """One round: status, then the wanted topics concurrently. True if reachable."""
        self.polling = True
        try:
            data = await self._fetch()
        except AdminError as exc:
            self._backoff = min(MAX_BACKOFF, self._backoff * 2 if self._backoff else FIRST_BACKOFF)
            self.state.record_failure(_describe(exc), self.clock.time(), self._backoff)
            self.on_update(self.state)
            return False
        finally:
            self.polling = False
        self._backoff = 0.0
        self.state.record_ok(data, self.clock.time(), self.clock.monotonic())
        self.on_update(self.state)
        return True

    async def run(self) -> None:
        """Poll until cancelled: after a success wait the interval, after a failure the backoff."""
        while True:
            ok = await self.poll_once()
            delay = self.settings.interval if ok else self._backoff
            await self._sleep(delay)

    async def _sleep(self, delay: float) -> None:
        self._wake.clear()
        if self.settings.paused:
            # Paused: only an explicit wake (refresh key, unpause, view switch) polls.
            await self._wake.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
        self._wake.clear()

    async def _fetch(self) -> dict[str, Any]:
        status = await self.client.status()
        topics = sorted(self.topics)
        results = await asyncio.gather(*(self._topic(t) for t in topics), return_exceptions=True)
        data: dict[str, Any] = {"status": status}
        errors: dict[str, str] = {}
        for topic, result in zip(topics, results, strict=True):
            if isinstance(result, AdminUnavailable):
                raise result
            if isinstance(result, AdminHTTPError):
                # The proxy answers but not this (older proxy, 401 on one path...):
                # keep it reachable and say what failed in the view.
                errors[topic] = f"{result.status} {result.code}"
            elif isinstance(result, BaseException):
                raise result
            else:
                data[topic] = result
        self.state.topic_errors = errors
        return data

    async def _topic(self, topic: str) -> Any:
        c, s = self.client, self.settings
        if topic == "top":
            return await c.top(by=s.top_by, limit=s.top_limit, histogram=s.top_histograms)
        if topic == "hot":
            return await c.hot(limit=s.hot_limit)
        if topic == "clients":
            return await c.clients(limit=500)
        if topic == "servers":
            return await c.servers(limit=500)
        return await getattr(c, topic)()


def _describe(exc: AdminError) -> str:
    if isinstance(exc, AdminHTTPError):
        return f"{exc.status} {exc.code}: {exc.message}"
    text = str(exc)
    # "http://127.0.0.1:6480: All connection attempts failed" -> the part after the URL
    _, sep, rest = text.partition(": ")
    return rest if sep else text
