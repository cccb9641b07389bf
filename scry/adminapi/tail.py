"""The live tail across workers.

A single process's tail is an ``Observatory`` subscription (scry.adminapi.server).
With several workers, worker 0 merges the instance's events::

    worker 0's own subscription ─────────────┐
    worker 1: peering stream {"op": "tail"} ──┼─► FleetTail: one bounded buffer ─► the HTTP stream
    worker N: peering stream {"op": "tail"} ──┘   (client ids qualified: w1.c12)

On the peering socket, ``stream_tail`` (the other worker's side) answers
``{"op": "tail", "filter": {...}}`` with NDJSON lines: first
``{"type": "subscribed"}``, then one event object per line and, when its own
buffer dropped events for a slow reader, ``{"type": "dropped", "dropped": N}``
(running total). It ends when worker 0 closes the connection (watched, so an
idle subscription never lingers) or the worker stops. Worker 0 reconnects to
a worker whose stream ended (a restarted worker) every ``RECONNECT_DELAY``.

Events of different workers are interleaved as they arrive: each worker's in
order, the workers' within about one drain of each other (30 ms when
statements are busy, at most ~130 ms when they are few).
Nothing here waits on the query path: each worker's events reach its stream
through the same bounded, drop-oldest subscription as a local tail.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from scry.adminapi.fleet import qualify_event
from scry.observe.events import Subscription

if TYPE_CHECKING:
    from scry.adminapi.instance import Instance
    from scry.proxy import Proxy

__all__ = [
    "TAIL_BATCH",
    "TAIL_BUFFER",
    "TAIL_HEARTBEAT",
    "TAIL_WRITE_TIMEOUT",
    "FleetTail",
    "stream_tail",
]

TAIL_BUFFER = 1_000  # events held for one slow tail reader before the oldest is dropped
TAIL_HEARTBEAT = 1.0  # seconds between heartbeats on an idle tail
TAIL_WRITE_TIMEOUT = 30.0  # a reader that takes no bytes this long is disconnected
TAIL_BATCH = 200  # events written per write() call at most
RECONNECT_DELAY = 1.0  # seconds before worker 0 asks a worker whose stream ended again
LINE_LIMIT = 1 << 22  # one event line at most (a long normalized statement)


async def stream_tail(
    proxy: Proxy,
    request: dict[str, Any],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Another worker's side of a peering tail: this worker's events as NDJSON."""
    subscription = proxy.observatory.subscribe(request.get("filter") or {}, maxsize=TAIL_BUFFER)
    # Worker 0 never sends more: EOF means it ended the tail.
    watcher = asyncio.ensure_future(reader.read())
    watcher.add_done_callback(lambda _: subscription.close())
    reported = 0
    try:
        await _send(writer, [{"type": "subscribed"}])
        while True:
            try:
                first = await subscription.get()
            except asyncio.CancelledError:
                if subscription.closed:
                    break
                raise
            items: list[dict[str, Any]] = []
            if subscription.dropped != reported:
                reported = subscription.dropped
                items.append({"type": "dropped", "dropped": reported})
            items.append(first)
            while len(items) < TAIL_BATCH and not subscription.empty():
                items.append(subscription.get_nowait())
            await _send(writer, items)
    except (ConnectionError, TimeoutError):
        pass  # worker 0 left, or stopped reading
    finally:
        subscription.close()
        watcher.cancel()


async def _send(writer: asyncio.StreamWriter, items: list[dict[str, Any]]) -> None:
    writer.write("".join(json.dumps(i, separators=(",", ":")) + "\n" for i in items).encode())
    await asyncio.wait_for(writer.drain(), TAIL_WRITE_TIMEOUT)


def _ignore(_: Subscription) -> None:
    pass


class FleetTail:
    """The instance's tail: a Subscription-like merge of worker streams.

    ``get``/``get_nowait``/``empty``/``closed``/``dropped``/``close`` behave
    as an ``Observatory`` subscription's; ``missing`` names the workers whose
    events are not coming in now (not yet subscribed, gone, restarting).
    """

    def __init__(
        self,
        instance: Instance,
        workers: tuple[int, ...],
        wanted: dict[str, Any],
        maxsize: int = TAIL_BUFFER,
    ) -> None:
        self._instance = instance
        self._wanted = wanted
        self._buffer = Subscription(None, maxsize, _ignore)
        self._remote_dropped: dict[int, int] = {}
        self.missing: dict[int, str] = {}
        self._local: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        own = instance.proxy.worker_id
        for worker in workers:
            if worker == own:
                self._local = instance.proxy.observatory.subscribe(wanted, maxsize=maxsize)
                self._tasks.append(loop.create_task(self._pump_local(worker, self._local)))
            else:
                self.missing[worker] = "subscribing"
                self._tasks.append(loop.create_task(self._follow(worker)))

    @property
    def closed(self) -> bool:
        return self._buffer.closed

    @property
    def dropped(self) -> int:
        local = self._local.dropped if self._local is not None else 0
        return self._buffer.dropped + local + sum(self._remote_dropped.values())

    def empty(self) -> bool:
        return self._buffer.empty()

    def get_nowait(self) -> dict[str, Any]:
        return self._buffer.get_nowait()

    async def get(self) -> dict[str, Any]:
        return await self._buffer.get()

    def close(self) -> None:
        self._buffer.close()
        if self._local is not None:
            self._local.close()
        for task in self._tasks:
            task.cancel()

    async def _pump_local(self, worker: int, subscription: Subscription) -> None:
        offer = self._buffer.offer
        async for event in subscription:
            offer(qualify_event(worker, event))

    async def _follow(self, worker: int) -> None:
        """Stream one worker's events for as long as the tail lasts."""
        earlier = 0  # drops reported by that worker's previous streams
        while not self.closed:
            writer: asyncio.StreamWriter | None = None
            try:
                path = self._instance.socket_path(worker)
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(path), limit=LINE_LIMIT),
                    self._instance.timeout,
                )
                message = {"op": "tail", "filter": self._wanted}
                writer.write(b"J" + json.dumps(message).encode() + b"\n")
                ack = await asyncio.wait_for(reader.readline(), self._instance.timeout)
                if json.loads(ack).get("type") != "subscribed":
                    raise ValueError("no subscription")
                self.missing.pop(worker, None)
                offer = self._buffer.offer
                async for line in reader:
                    item = json.loads(line)
                    if item.get("type") == "dropped":
                        self._remote_dropped[worker] = earlier + int(item["dropped"])
                    else:
                        offer(qualify_event(worker, item))
                self.missing[worker] = "stream ended"
            except TimeoutError:
                self.missing[worker] = "timeout"
            except (OSError, ValueError) as exc:
                self.missing[worker] = f"unreachable: {exc}"
            finally:
                if writer is not None:
                    writer.close()
            earlier = self._remote_dropped.get(worker, earlier)
            await asyncio.sleep(RECONNECT_DELAY)
