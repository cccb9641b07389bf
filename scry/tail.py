"""``scry tail``: stream anonymized query events from an admin endpoint to stdout.

Talks to the proxy only through :mod:`admin` (the same client the console
uses). One event per line: aligned, human-readable columns by default, or
the event as JSON with ``--json``. Notices (reconnecting, events dropped
because we read too slowly) go to stderr so that stdout stays pipeable.

* A proxy restart is survived: the stream is reopened, with a notice, with
  back-off up to ``MAX_BACKOFF``. Only the first connection failing is an
  error (exit 1: unreachable target), as are a wrong token and bad filters.
* Ctrl-C ends it with status 0; so does a closed pipe (``scry tail | head``),
  noticed on the next write, or at the next heartbeat (about a second) when
  no events come.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
import time
from typing import IO

from rich.console import Console
from rich.text import Text

from admin import AdminClient, AdminHTTPError, AdminUnavailable, TailEvent, TailNotice

MAX_BACKOFF = 5.0


class _PipeClosed(Exception):
    """stdout's reader went away."""


class TailPrinter:
    """Formats events for a terminal or a pipe."""

    def __init__(self, out: IO[str], as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.tty = out.isatty()
        # Rendered to a string, then written by us: rich's own writes turn a
        # closed pipe into SystemExit(1), and a pipe wants plain text.
        self.console = Console(file=out, highlight=False) if self.tty else None

    def event(self, ev: TailEvent) -> None:
        if self.as_json:
            self.out.write(ev.model_dump_json() + "\n")
        elif self.console is None:
            self.out.write(self._line(ev).plain + "\n")
        else:
            line = self._line(ev)
            line.truncate(self.console.width, overflow="ellipsis")
            with self.console.capture() as captured:
                self.console.print(line, no_wrap=True, crop=True)
            self.out.write(captured.get())
        self.out.flush()

    def _line(self, ev: TailEvent) -> Text:
        clock = time.strftime("%H:%M:%S", time.localtime(ev.ts)) + f".{int(ev.ts % 1 * 1000):03d}"
        ms = ev.total_us / 1000
        line = Text()
        line.append(clock, style="dim")
        line.append(f"  {ev.client_id:>7}  {ev.database[:12]:<12}  ")
        line.append(f"{ms:>9.2f} ms", style="bold red" if ms >= 1000 else "bold")
        line.append(f"  {ev.rows:>6} rows  ")
        if ev.sqlstate:
            line.append(f"{ev.sqlstate:<5}", style="bold red")
        else:
            line.append("ok   ", style="green")
        line.append(f"  {ev.fingerprint[:8]}  ", style="cyan")
        if ev.pinned:
            line.append("[pinned] ", style="yellow")
        line.append(" ".join(ev.query.split()))
        return line


def _stdout_closed(out: IO[str]) -> bool:
    """True when ``out`` is a pipe whose reader has gone (Linux reports POLLERR)."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR / POLLHUP are always reported
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))


def _notice(message: str) -> None:
    print(f"scry tail: {message}", file=sys.stderr, flush=True)


async def stream(
    target: str | None,
    token: str | None,
    *,
    as_json: bool = False,
    fingerprint: str | None = None,
    min_ms: float | None = None,
    errors: bool = False,
    out: IO[str] | None = None,
) -> int:
    """Print events until interrupted; returns the exit status."""
    out = sys.stdout if out is None else out
    printer = TailPrinter(out, as_json)
    connected_once = False
    dropped_seen = 0
    backoff = 0.25
    # Ctrl-C (or SIGTERM) ends the tail: a flag, checked at every step, and a
    # cancel to wake a quiet stream. The flag matters: a cancel delivered while
    # the HTTP library closes a connection can be absorbed by it, and the tail
    # would then just reconnect.
    interrupted = False
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        if main is not None:
            main.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupt)
    async with AdminClient(target, token) as client:
        while not interrupted:
            try:
                async for item in client.tail(
                    fingerprint=fingerprint, min_ms=min_ms, errors=errors
                ):
                    if interrupted:
                        return 0
                    if not connected_once:
                        connected_once = True
                    backoff = 0.25
                    if isinstance(item, TailEvent):
                        printer.event(item)
                    elif isinstance(item, TailNotice):
                        if item.dropped > dropped_seen:
                            _notice(f"{item.dropped - dropped_seen} events dropped (reading too slowly)")  # fmt: skip
                        dropped_seen = item.dropped
                        if _stdout_closed(out):
                            raise _PipeClosed
                # The proxy closed the stream (it is stopping): reconnect.
                _notice(f"stream from {client.base_url} ended; reconnecting")
            except AdminHTTPError as exc:
                _notice(f"{client.base_url}: {exc.message}")
                return 1
            except AdminUnavailable as exc:
                if not connected_once:
                    _notice(f"cannot reach {exc}")
                    return 1
                _notice(f"connection lost ({exc}); reconnecting")
            except (BrokenPipeError, _PipeClosed):
                return 0
            except asyncio.CancelledError:
                if interrupted:
                    return 0
                raise
            if interrupted:
                return 0
            dropped_seen = 0  # a new stream counts its own drops
            try:
                await asyncio.sleep(backoff)
            except asyncio.CancelledError:
                if interrupted:
                    return 0
                raise
            backoff = min(MAX_BACKOFF, backoff * 2)
    return 0


def tail_main(
    target: str | None,
    token: str | None,
    *,
    as_json: bool = False,
    fingerprint: str | None = None,
    min_ms: float | None = None,
    errors: bool = False,
) -> int:
    """``scry tail``: run :func:`stream`; Ctrl-C and a closed pipe exit 0."""
    try:
        status = asyncio.run(
            stream(
                target,
                token,
                as_json=as_json,
                fingerprint=fingerprint,
                min_ms=min_ms,
                errors=errors,
            )
        )
    except (KeyboardInterrupt, asyncio.CancelledError):  # (Ctrl-C: see stream)
        status = 0
    except BrokenPipeError:
        status = 0
    if status == 0:
        _silence_stdout()
    return status


def _silence_stdout() -> None:
    """After a closed pipe, make the interpreter's final flush of stdout a no-op
    (otherwise Python prints 'Exception ignored ... BrokenPipeError')."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
