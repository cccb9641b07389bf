"""Live tail streams, one per proxy, reconnecting until stopped.

The console opens ``GET /api/v1/tail`` on every proxy it shows events from
and hands each event to a callback with the proxy's name. A dropped stream
(proxy restart, tunnel drop) is reopened with backoff; the callback hears
about it as a notice so the view can say so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from admin import AdminClient, AdminHTTPError, AdminUnavailable, TailEvent, TailNotice

MAX_BACKOFF = 10.0


@dataclass(frozen=True)
class TailFilter:
    """Filters applied in the proxy (``GET /api/v1/tail?...``)."""

    fingerprint: str | None = None
    min_ms: float | None = None
    errors: bool = False


class TailFeed:
    """One streaming task per proxy; :meth:`stop` cancels them all."""

    def __init__(
        self,
        clients: dict[str, AdminClient],
        on_event: Callable[[str, TailEvent], None],
        on_notice: Callable[[str, str], None] | None = None,
        tail_filter: TailFilter | None = None,
    ) -> None:
        self.clients = clients
        self.on_event = on_event
        self.on_notice = on_notice or (lambda name, text: None)
        self.filter = tail_filter or TailFilter()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.dropped: dict[str, int] = {}
        self.connected: set[str] = set()
        self._cancelled: list[asyncio.Task[None]] = []

    @property
    def running(self) -> bool:
        return bool(self.tasks)

    def start(self) -> None:
        for name, client in self.clients.items():
            if name not in self.tasks:
                self.tasks[name] = asyncio.create_task(
                    self._follow(name, client), name=f"tail {name}"
                )

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel every stream now; returns the tasks (await them with :meth:`stop`)."""
        tasks, self.tasks = list(self.tasks.values()), {}
        for task in tasks:
            task.cancel()
        self.connected.clear()
        self._cancelled.extend(tasks)
        return tasks

    async def stop(self) -> None:
        """Cancel every stream and wait until they are gone."""
        self.cancel()
        tasks, self._cancelled = self._cancelled, []
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _follow(self, name: str, client: AdminClient) -> None:
        backoff = 0.5
        while True:
            try:
                async for item in client.tail(
                    fingerprint=self.filter.fingerprint,
                    min_ms=self.filter.min_ms,
                    errors=self.filter.errors,
                ):
                    if name not in self.connected:
                        self.connected.add(name)
                        backoff = 0.5
                    if isinstance(item, TailEvent):
                        self.on_event(name, item)
                    elif isinstance(item, TailNotice) and item.type == "dropped":
                        self.dropped[name] = item.dropped
                        self.on_notice(name, f"{item.dropped} events dropped (reader too slow)")
            except AdminHTTPError as exc:
                self.connected.discard(name)
                self.on_notice(name, f"tail refused: {exc.status} {exc.code}")
                return
            except (AdminUnavailable, ValueError) as exc:
                if name in self.connected:
                    self.on_notice(name, f"tail lost: {exc}; reconnecting")
                self.connected.discard(name)
            else:
                self.connected.discard(name)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF, backoff * 2)
