"""Entry points the ``scry`` CLI calls: the interactive console and headless screenshots.

Kept free of Typer: the CLI parses arguments and calls these with plain
values; they return an exit code (0 ok, 1 user error).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from scry_tui.actions import VIEW_IDS
from scry_tui.targets import Fleet, TargetError, resolve_targets

DEFAULT_SCREENSHOT_VIEWS = VIEW_IDS
SCREENSHOT_SIZE = (160, 44)


def _error(message: str) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]scry: {message}[/red]")
    return 1


def load_fleet_or_exit(
    targets: list[str] | None, token: str | None, fleet_file: Path | None
) -> Fleet | int:
    try:
        return resolve_targets(targets, token=token, fleet_file=fleet_file)
    except TargetError as exc:
        return _error(str(exc))


def run_console(
    targets: list[str] | None,
    *,
    view: str = "fleet",
    token: str | None = None,
    fleet_file: Path | None = None,
    read_only: bool = False,
    refresh: float | None = None,
    screenshot_dir: Path | None = None,
) -> int:
    """``scry console`` / ``scry top``: run the console until the operator quits."""
    from scry_tui.app import ScryConsole

    fleet = load_fleet_or_exit(targets, token, fleet_file)
    if isinstance(fleet, int):
        return fleet
    if not sys.stdout.isatty():
        return _error("the console needs a terminal; use `scry screenshot` or `scry tail` instead")
    app = ScryConsole(
        fleet.targets,
        view=view,
        read_only=read_only or bool(fleet.read_only),
        refresh=refresh or fleet.refresh or 2.0,
        screenshot_dir=screenshot_dir,
        source=fleet.source,
    )
    app.run()
    return 0


async def capture_views(
    fleet: Fleet,
    out: Path,
    views: list[str],
    *,
    size: tuple[int, int] = SCREENSHOT_SIZE,
    settle: float = 2.0,
    timeout: float = 10.0,
    read_only: bool = True,
    name_template: str = "scry-{view}-{stamp}.svg",
    **app_kwargs: Any,
) -> tuple[list[Path], list[str]]:
    """Render ``views`` headless and save each as an SVG in ``out``.

    Returns the files written and the names of the targets that answered.

    Polls twice per view (so ↑/↓ deltas and calls/s have a previous refresh),
    and lets the Tail view collect events for ``settle`` seconds.
    """
    from scry_tui.app import ScryConsole

    app = ScryConsole(fleet.targets, view=views[0], read_only=read_only, refresh=2.0, **app_kwargs)
    paths: list[Path] = []
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    async with app.run_test(size=size) as pilot:
        await wait_first_poll(app, pilot, timeout)
        for view in views:
            app.show_view(view)
            await poll_round(app, pilot, timeout)
            await asyncio.sleep(settle / 2 if view != "tail" else settle)
            await poll_round(app, pilot, timeout)
            await pilot.pause()
            name = name_template.format(view=view, stamp=stamp)
            paths.append(app.save_view_screenshot(out, name))
        reachable = [s.name for s in app.states.values() if s.polls]
    return paths, reachable


async def wait_first_poll(app: object, pilot: object, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    states = app.states.values()  # type: ignore[attr-defined]
    while loop.time() < deadline:
        if all(s.polls or s.failures for s in states):
            break
        await asyncio.sleep(0.05)


async def poll_round(app: object, pilot: object, timeout: float) -> None:
    """Wake every poller and wait until each finished one more round."""
    loop = asyncio.get_running_loop()
    states = list(app.states.values())  # type: ignore[attr-defined]
    before = [(s.polls, s.failures) for s in states]
    app.action_refresh_now()  # type: ignore[attr-defined]
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        now = [(s.polls, s.failures) for s in states]
        if all(n != b or (s.unreachable_since is not None) for n, b, s in zip(now, before, states, strict=True)):  # fmt: skip
            break
        await asyncio.sleep(0.05)
    await pilot.pause()  # type: ignore[attr-defined]


def run_screenshots(
    targets: list[str] | None,
    *,
    out: Path,
    views: list[str],
    token: str | None = None,
    fleet_file: Path | None = None,
    size: tuple[int, int] = SCREENSHOT_SIZE,
    settle: float = 2.0,
) -> int:
    """``scry screenshot``: one SVG per view; exit 1 if no target answered."""
    unknown = [v for v in views if v not in VIEW_IDS]
    if unknown:
        return _error(f"unknown view {', '.join(unknown)}; choose from {', '.join(VIEW_IDS)}")
    fleet = load_fleet_or_exit(targets, token, fleet_file)
    if isinstance(fleet, int):
        return fleet
    paths, reachable = asyncio.run(capture_views(fleet, out, views, size=size, settle=settle))
    for path in paths:
        print(path)
    if not reachable:
        return _error("no target answered: " + ", ".join(t.display for t in fleet.targets))
    return 0
