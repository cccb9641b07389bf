"""The peering socket's handler (scry.peering.Peering._on_connection), on a
real Unix socket and event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from scry.peering import Peering
from scry.protocol.startup import cancel_request
from scry.workers import WorkerIdentity


def test_a_request_cut_short_by_shutdown_logs_no_traceback(tmp_path: Path) -> None:
    """A forwarded cancel still awaiting PostgreSQL when the process stops:
    its handler is cancelled, and nothing reaches the loop's exception handler
    (Python 3.11's asyncio.streams logged one for a cancelled handler)."""
    path = str(tmp_path / "w0.sock")

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        problems: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: problems.append(context))
        asked = asyncio.Event()
        never_answered: asyncio.Future[None] = loop.create_future()

        def handle_cancel(pid: int, secret: int) -> asyncio.Future[None]:
            asked.set()
            return never_answered

        proxy = SimpleNamespace(identity=WorkerIdentity(), handle_cancel=handle_cancel)
        peering = Peering(proxy)
        server = await asyncio.start_unix_server(peering._on_connection, path)
        _reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"C" + cancel_request(1234, 5678))
        await writer.drain()
        await asyncio.wait_for(asked.wait(), 5)
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:  # what asyncio.run does to what is left at exit
            task.cancel()
        await asyncio.wait(handlers, timeout=5)
        for _ in range(3):  # (the done callbacks run on the next turns)
            await asyncio.sleep(0)
        writer.close()
        server.close()
        return problems

    assert asyncio.run(main()) == []
