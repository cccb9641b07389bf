"""Snapshot tests of every console view (pytest-textual-snapshot).

The proxies are :class:`scry_tui.testing.FakeAdmin` behind httpx's
MockTransport and the clock is frozen, so each image is deterministic.
After an intended change to the console, review and accept the new images::

    .venv/bin/python -m pytest tests/unit/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest

from scry_tui.testing import fake_console, refreshed

SIZE = (160, 44)
TWO = ("eu-west-1", "us-east-1")


def _run_before(view: str, rounds: int = 3, keys: tuple[str, ...] = (), down: str | None = None):  # type: ignore[no-untyped-def]
    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        app = pilot.app
        await refreshed(pilot, app, rounds, app.clock)
        if down:
            app.fakes[down].down = True
            await refreshed(pilot, app, 1, app.clock)
        if keys:
            # A blinking cursor would make the picture depend on the machine's speed.
            for widget in app.query("Input"):
                widget.cursor_blink = False
            await pilot.press(*keys)
        await pilot.pause()

    return run_before


def _app(view: str, names: tuple[str, ...] = TWO, **kwargs):  # type: ignore[no-untyped-def]
    app, fakes, _clock = fake_console(names=names, view=view, **kwargs)
    app.fakes = fakes  # type: ignore[attr-defined]
    return app


@pytest.mark.parametrize("view", ["fleet", "top", "pools", "pins", "breaker", "hot"])
def test_view(snap_compare, view: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app(view), terminal_size=SIZE, run_before=_run_before(view))


def test_tail(snap_compare) -> None:  # type: ignore[no-untyped-def]
    # One proxy: two streams would interleave in scheduling order.
    app = _app("tail", names=("eu-west-1",))
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("tail", 1))


def test_top_detail(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = _app("top", names=("eu-west-1",))
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("top", 2, ("enter",)))


def test_help(snap_compare) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app("top"), terminal_size=SIZE, run_before=_run_before("top", 1, ("question_mark",)))  # fmt: skip


def test_confirm_force_unpin(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = _app("pins", names=("eu-west-1",))
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("pins", 1, ("down", "u")))


def test_fleet_with_a_proxy_down(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = _app("fleet")
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("fleet", 2, down="us-east-1"))  # fmt: skip


def test_pins_read_only(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = _app("pins", read_only=True)
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("pins", 1))


def test_filter_prompt(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = _app("top")
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before("top", 1, ("slash", *"orders")))  # fmt: skip
