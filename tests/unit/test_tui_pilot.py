"""Key flows of the console, driven with Textual's pilot against fake proxies (no network)."""

from __future__ import annotations

import html
import os
from pathlib import Path

from textual.widgets import DataTable, RichLog

from scry_tui.screens import ConfirmScreen, DetailScreen, HelpScreen
from scry_tui.testing import fake_console, refreshed
from scry_tui.views import FleetView, TailView
from scry_tui.views.base import selected_key

SIZE = (160, 44)


def _keys(table: DataTable) -> list[str]:  # type: ignore[type-arg]
    return [row.key.value for row in table.ordered_rows]  # type: ignore[misc]


async def test_number_keys_jump_and_help() -> None:
    app, _, clock = fake_console()
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        assert app.current_view == "fleet"
        for key, view in (("2", "top"), ("4", "pools"), ("7", "hot"), ("1", "fleet")):
            await pilot.press(key)
            assert app.current_view == view
        await pilot.press("colon", *"pins", "enter")
        assert app.current_view == "pins"
        await pilot.press("colon", *"nope", "enter")
        assert app.current_view == "pins"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_filter_narrows_rows_and_escape_clears() -> None:
    app, _, clock = fake_console(view="top")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        table = app.query_one("#top-table", DataTable)
        assert table.row_count == 10
        await pilot.press("slash", *"orders")
        assert app.view().filter_text == "orders"
        assert 0 < table.row_count < 10
        assert all(
            "orders" in app.query_one("#top").rows[k].query.query.lower() for k in _keys(table)
        )
        await pilot.press("enter")  # keeps the filter, closes the prompt
        assert app.view().filter_text == "orders" and table.has_focus
        await pilot.press("slash", "escape")  # escape clears it
        assert app.view().filter_text == "" and table.row_count == 10


async def test_cursor_stays_on_its_row_when_the_ranking_changes() -> None:
    app, _, clock = fake_console(names=("solo",), view="top")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        table = app.query_one("#top-table", DataTable)
        watched = "1b2c3d4e5f6a7b8c"  # the order_items count, which climbs every refresh
        table.move_cursor(row=table.get_row_index(watched))
        before = table.cursor_row
        await refreshed(pilot, app, 3, clock)
        assert selected_key(table) == watched
        assert table.cursor_row < before, "it climbed, and the cursor went with it"
        # The climb shows as ↑ in the Δ column.
        assert app.query_one("#top").ranks[watched] < before + 1


async def test_several_proxies_are_asked_for_histograms_one_is_not() -> None:
    """Merging percentiles needs each proxy's histograms (scry_tui.model.merge_top);
    a lone proxy's own percentiles need none."""
    for names, wanted in ((("a", "b"), {"true"}), (("solo",), {None})):
        app, fakes, clock = fake_console(names=names, view="top")
        async with app.run_test(size=SIZE) as pilot:
            await refreshed(pilot, app, 1, clock)
        for fake in fakes.values():
            assert fake.top_params
            assert {params.get("histogram") for params in fake.top_params} == wanted


async def test_sort_cycles_and_scope_toggles() -> None:
    app, fakes, clock = fake_console(view="top")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        await pilot.press("s")
        assert app.settings.top_by == "mean"
        await refreshed(pilot, app, 1, clock)
        top = app.query_one("#top")
        means = [top.rows[k].query.mean_ms for k in _keys(app.query_one("#top-table", DataTable))]
        assert means == sorted(means, reverse=True)
        await pilot.press("m")
        assert app.top_scope == "eu-west-1"
        await pilot.press("n")
        assert app.top_scope == "us-east-1"
        # us-east-1 never ran pg_sleep: in its own scope the fingerprint is absent.
        assert "f0e1d2c3b4a59687" not in top.rows
        await pilot.press("m")
        assert app.top_scope is None and "f0e1d2c3b4a59687" in top.rows


async def test_enter_opens_the_detail_pane_with_a_filtered_live_tail() -> None:
    app, fakes, clock = fake_console(names=("solo",), view="top")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        table = app.query_one("#top-table", DataTable)
        fp = selected_key(table)
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        assert app.screen.row.query.fingerprint == fp
        await pilot.pause(0.2)
        samples = app.screen.samples
        assert samples and all(e.fingerprint == fp for e in samples)
        assert app.screen.query_one("#detail-tail", RichLog).lines
        await pilot.press("escape")
        assert not isinstance(app.screen, DetailScreen)
        assert app.detail_feed is None


async def test_tail_follows_filters_and_highlights_errors() -> None:
    app, _, clock = fake_console(names=("solo",), view="tail")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        tail = app.query_one(TailView)
        log = app.query_one("#tail-log", RichLog)
        assert tail.total == 24 and len(log.lines) == 24
        assert tail.errors > 0
        await pilot.press("e")  # errors only
        assert len(log.lines) == tail.errors
        await pilot.press("e", "slash", *"no_such", "enter")
        assert 0 < len(log.lines) < 24
        await pilot.press("f")
        assert not tail.following
        await pilot.press("p")
        assert app.settings.paused
        await pilot.press("p", "f")
        assert tail.following and not app.settings.paused


async def test_force_unpin_asks_first_and_names_the_client() -> None:
    app, fakes, clock = fake_console(names=("solo",), view="pins")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        table = app.query_one("#pins-table", DataTable)
        table.move_cursor(row=table.get_row_index("solo\x1fc117"))
        await pilot.press("u")
        assert isinstance(app.screen, ConfirmScreen)
        assert "c117" in app.screen.title_text and "solo" in app.screen.title_text
        await pilot.press("n")  # cancel: nothing sent
        assert not isinstance(app.screen, ConfirmScreen)
        assert fakes["solo"].actions == []
        await pilot.press("u")
        await pilot.press("y")
        await pilot.pause(0.2)
        assert fakes["solo"].actions == [("/pins/c117/unpin", {"disconnect": "false"})]


async def test_trip_and_reset_the_breaker_with_confirmation() -> None:
    app, fakes, clock = fake_console(names=("solo",), view="breaker")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        await pilot.press("T")
        assert isinstance(app.screen, ConfirmScreen) and "app" in app.screen.title_text
        await pilot.press("y")
        await pilot.pause(0.2)
        await refreshed(pilot, app, 1, clock)
        assert fakes["solo"].actions[0][0] == "/breaker/trip"
        assert fakes["solo"].breaker_state == "open"
        await pilot.press("R", "y")
        await pilot.pause(0.2)
        assert fakes["solo"].actions[-1][0] == "/breaker/reset"


async def test_read_only_hides_and_refuses_destructive_actions() -> None:
    app, fakes, clock = fake_console(names=("solo",), view="pins", read_only=True)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await refreshed(pilot, app, 1, clock)
        assert app.check_action("unpin", ()) is False  # not in the footer, help or palette
        await pilot.press("u")
        assert not isinstance(app.screen, ConfirmScreen)
        assert any("read-only" in n.message for n in app._notifications)
        app.action_unpin()  # even invoked directly (palette, keymap) it refuses
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("6", "T", "R")
        assert not isinstance(app.screen, ConfirmScreen)
        assert fakes["solo"].actions == []
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert not any("Force-unpin" in t or "Trip" in t for t in titles)


async def test_proxy_going_down_and_coming_back() -> None:
    app, fakes, clock = fake_console()
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        state = app.states["us-east-1"]
        assert state.up
        fakes["us-east-1"].down = True
        await refreshed(pilot, app, 1, clock)
        assert state.unreachable_since == clock.time()
        assert state.retry_in == 1.0  # first backoff step
        fleet = app.query_one(FleetView)
        status = fleet.query_one("#fleet-table", DataTable).get_cell("us-east-1", "status")
        assert "unreachable since 13:26:44" in str(status)
        assert "unreachable since" in str(app.query_one("#topbar").render())
        # The other proxy keeps refreshing; the UI never waited for the dead one.
        assert app.states["eu-west-1"].up
        await refreshed(pilot, app, 1, clock)
        assert state.retry_in == 2.0 and state.unreachable_since == clock.time() - 2
        fakes["us-east-1"].down = False
        await refreshed(pilot, app, 1, clock)
        assert state.up and state.unreachable_since is None and state.failures == 0
        status = fleet.query_one("#fleet-table", DataTable).get_cell("us-east-1", "status")
        assert "● up" in str(status)


async def test_refresh_rate_keys_and_screenshot_key(tmp_path: Path) -> None:
    app, _, clock = fake_console(names=("solo",), refresh=2.0, screenshot_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        await pilot.press("plus")
        assert app.settings.interval == 1.0
        await pilot.press("minus", "minus")
        assert app.settings.interval == 5.0
        await pilot.press("ctrl+s")
        files = sorted(os.listdir(tmp_path))
        assert len(files) == 1
        assert files[0].startswith("scry-fleet-") and files[0].endswith(".svg")
        svg = html.unescape((tmp_path / files[0]).read_text()).replace("\xa0", " ")  # noqa: ASYNC240
        assert "scry Fleet" in svg and "http://10.0.0.5:6480" in svg and "2024-05-01" in svg


async def test_command_palette_lists_registry_actions() -> None:
    app, _, clock = fake_console(names=("solo",), view="pins")
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 1, clock)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert any(t.startswith("Force-unpin") for t in titles)
        assert any(t.startswith("Top (views)") for t in titles)
        assert not any(t.startswith("Sort") for t in titles)  # Top-only


async def test_several_proxies_are_asked_for_lists_deep_enough_to_merge() -> None:
    """One row from each of two proxies cannot settle a merged top 3: the next
    poll asks for 6 (scry_tui.model.top_fetch_limit), and the view shows 3 rows."""
    app, fakes, clock = fake_console(names=("a", "b"), view="top")
    app.settings.top_shown, app.settings.top_limit = 3, 1
    async with app.run_test(size=SIZE) as pilot:
        await refreshed(pilot, app, 2, clock)
        for fake in fakes.values():
            assert [params["limit"] for params in fake.top_params][:2] == ["1", "6"]
        assert len(_keys(app.query_one("#top-table", DataTable))) == 3
