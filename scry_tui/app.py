"""The scry console: a Textual app over one or many proxies' admin APIs.

Layout: a top bar (targets, their state, refresh rate, time), tabs of the
views, the current view, a prompt line for ``/`` and ``:``, the footer.
Every key comes from :mod:`scry_tui.actions`. Data comes from one
:class:`~scry_tui.poller.Poller` per proxy (run as a Textual worker, so
nothing waits on the network in the UI) and, for the Tail view and the
detail pane, from :class:`~scry_tui.tailfeed.TailFeed` streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
from rich.text import Text
from textual import events, on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher, DataTable, Footer, Input, Static, Tab, Tabs

from admin import AdminClient, AdminError, TailEvent
from scry_tui import fmt
from scry_tui.actions import (
    ACTION_BY_NAME,
    ACTIONS,
    DESTRUCTIVE_KEYS,
    VIEW_IDS,
    VIEWS,
    ActionSpec,
    bindings,
    view_for,
)
from scry_tui.model import SORT_LABELS, SORTS, ProxyState
from scry_tui.poller import TOPICS_BY_VIEW, Clock, Poller, PollSettings, SystemClock
from scry_tui.screens import ConfirmScreen, DetailScreen, HelpScreen
from scry_tui.tailfeed import TailFeed, TailFilter
from scry_tui.targets import Target
from scry_tui.tunnel import SSHTunnel
from scry_tui.views import VIEW_CLASSES, BreakerView, PinsView, PoolsView, TailView, TopView
from scry_tui.views.base import View

REFRESH_STEPS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

TransportFactory = Callable[[Target], httpx.AsyncBaseTransport | None]


class ProxyUpdated(Message):
    """A poller has new data (or a new failure) for one proxy."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class PromptInput(Input):
    """The `/` and `:` line; escape cancels it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="prompt.cancel")]

    def action_cancel(self) -> None:
        self.app.cancel_prompt()  # type: ignore[attr-defined]


class ScryConsole(App[None]):
    """The operator console."""

    TITLE = "scry console"
    CSS_PATH = "console.tcss"
    BINDINGS = bindings()
    ENABLE_COMMAND_PALETTE = True

    def __init__(
        self,
        targets: list[Target],
        *,
        view: str = "fleet",
        read_only: bool = False,
        refresh: float = 2.0,
        clock: Clock | None = None,
        tz: dt.tzinfo | None = None,
        transport_factory: TransportFactory | None = None,
        screenshot_dir: Path | None = None,
        source: str = "",
    ) -> None:
        super().__init__()
        if view not in VIEW_IDS:
            raise ValueError(f"unknown view {view!r}; one of {', '.join(VIEW_IDS)}")
        self.targets = targets
        self.initial_view = view
        self.current_view = view
        self.read_only = read_only
        # Several proxies: their rankings merge, exact percentiles need histograms,
        # and each proxy's list goes deeper than the rows shown (top_fetch_limit).
        fleet = len(targets) > 1
        self.settings = PollSettings(interval=refresh, top_histograms=fleet)
        if fleet:
            self.settings.top_limit = 2 * self.settings.top_shown
        self.clock: Clock = clock or SystemClock()
        self.tz = tz
        self.transport_factory = transport_factory
        self.screenshot_dir = screenshot_dir or Path.cwd()
        self.source = source
        self.states: dict[str, ProxyState] = {
            t.name: ProxyState(name=t.name, display=t.display) for t in targets
        }
        self.clients: dict[str, AdminClient] = {}
        self.pollers: dict[str, Poller] = {}
        self.tunnels: dict[str, SSHTunnel] = {}
        self.top_scope: str | None = None  # None: the whole fleet
        self.tail_feed: TailFeed | None = None
        self.detail_feed: TailFeed | None = None
        self.detail_screen: DetailScreen | None = None
        self.feeds: list[TailFeed] = []  # every feed started, stopped for good at exit
        self.prompt_mode = ""
        self._closed = False

    # --- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="topbar")
        yield Tabs(
            *(Tab(f"{n} {title}", id=f"tab-{vid}") for n, (vid, title, _) in enumerate(VIEWS, 1)),
            id="tabs",
            active=f"tab-{self.initial_view}",
        )
        with ContentSwitcher(initial=self.initial_view, id="views"):
            for cls in VIEW_CLASSES:
                yield cls(id=cls.view_id)
        yield PromptInput(id="prompt", placeholder="")
        yield Footer()

    def on_mount(self) -> None:
        for target in self.targets:
            url = target.url
            if target.ssh is not None:
                tunnel = SSHTunnel(target.ssh, target.ssh_options)
                self.tunnels[target.name] = tunnel
                tunnel.start()
                url = tunnel.url
            transport = self.transport_factory(target) if self.transport_factory else None
            client = AdminClient(url, target.token, transport=transport, timeout=5.0)
            self.clients[target.name] = client
            poller = Poller(
                client,
                self.states[target.name],
                self.settings,
                lambda state: self.post_message(ProxyUpdated(state.name)),
                self.clock,
            )
            poller.topics = set(TOPICS_BY_VIEW[self.initial_view])
            self.pollers[target.name] = poller
            self.run_worker(poller.run(), name=f"poll {target.name}", group="pollers")
        self.set_interval(1.0, self.update_topbar)
        self.update_topbar()
        self.show_view(self.initial_view)

    def ordered_states(self) -> list[ProxyState]:
        return [self.states[t.name] for t in self.targets]

    def view(self, view_id: str | None = None) -> View:
        return self.query_one(f"#{view_id or self.current_view}", View)

    # --- data flow --------------------------------------------------------------------

    def on_proxy_updated(self, message: ProxyUpdated) -> None:
        if self._closed or not self.screen_stack:
            return
        self.update_topbar()
        if self.current_view != "tail":
            self.view().refresh_view()

    def status_text(self, state: ProxyState) -> Text:
        """● up 3h12m, or ✖ unreachable since 14:03:07 (2m10s)."""
        now = self.clock.time()
        if state.unreachable_since is not None:
            text = Text(f"✖ unreachable since {fmt.clock(state.unreachable_since, self.tz)}", style="bold red")  # fmt: skip
            text.append(f" ({fmt.duration(now - state.unreachable_since)})", style="red")
            return text
        if state.status is None:
            return Text("… connecting", style="dim")
        s = state.status
        if s.draining:
            return Text("◐ draining", style="yellow")
        if s.paused:
            return Text("⏸ paused", style="yellow")
        return Text(f"● up {fmt.duration(s.uptime_s)}", style="green")

    def update_topbar(self) -> None:
        try:
            topbar = self.query_one("#topbar", Static)
        except NoMatches:  # shutting down
            return
        bar = Text()
        bar.append(" scry ", style="bold reverse")
        bar.append(" console ", style="bold")
        view_title = dict((v, t) for v, t, _ in VIEWS)[self.current_view]
        bar.append(f"▸ {view_title}", style="bold cyan")
        bar.append("   ")
        for state in self.ordered_states():
            if state.unreachable_since is not None:
                bar.append(f"✖ {state.name} ", style="bold red")
                bar.append(f"unreachable since {fmt.clock(state.unreachable_since, self.tz)}  ", style="red")  # fmt: skip
            elif state.status is None:
                bar.append(f"… {state.name}  ", style="dim")
            else:
                bar.append(f"● {state.name}  ", style="green")
        bar.append("⟳ ", style="dim")
        bar.append(f"{self.settings.interval:g}s", style="bold")
        if self.settings.paused:
            bar.append("  ⏸ PAUSED", style="bold black on yellow")
        if self.read_only:
            bar.append("  read-only", style="bold yellow")
        bar.append(f"   {fmt.stamp(self.clock.time(), self.tz)}", style="dim")
        topbar.update(bar)

    # --- views ------------------------------------------------------------------------

    def show_view(self, view_id: str) -> None:
        if view_id not in VIEW_IDS:
            return
        self.current_view = view_id
        self.query_one(ContentSwitcher).current = view_id
        tabs = self.query_one(Tabs)
        if tabs.active != f"tab-{view_id}":
            tabs.active = f"tab-{view_id}"
        for poller in self.pollers.values():
            poller.want(TOPICS_BY_VIEW[view_id])
        if view_id == "tail":
            self.start_tail()
        else:
            self.stop_tail()
        view = self.view()
        view.refresh_view()
        tables = list(view.query(DataTable))
        if tables:
            tables[0].focus()
        self.update_topbar()
        self.refresh_bindings()

    @on(Tabs.TabActivated)
    def _tab_activated(self, event: Tabs.TabActivated) -> None:
        view_id = (event.tab.id or "").removeprefix("tab-")
        if self._closed or not self.pollers:
            return
        if view_id and view_id != self.current_view:
            self.show_view(view_id)

    # --- the tail ---------------------------------------------------------------------

    def live_clients(self) -> dict[str, AdminClient]:
        return dict(self.clients)

    def start_tail(self) -> None:
        if self.tail_feed is not None and self.tail_feed.running:
            return
        tail = self.query_one(TailView)
        self.tail_feed = TailFeed(
            self.live_clients(),
            lambda name, e: tail.add_event(name, e),
            lambda name, text: tail.add_notice(name, text),
        )
        self.feeds.append(self.tail_feed)
        if not self.settings.paused:
            self.tail_feed.start()

    def stop_tail(self) -> None:
        feed, self.tail_feed = self.tail_feed, None
        if feed is not None:
            feed.cancel()

    def start_detail_tail(self, screen: DetailScreen) -> None:
        self.detail_screen = screen
        fingerprint = screen.row.query.fingerprint

        def on_event(name: str, event: TailEvent) -> None:
            if self.detail_screen is screen and not self.settings.paused:
                screen.add_event(name, event)

        self.detail_feed = TailFeed(self.live_clients(), on_event, tail_filter=TailFilter(fingerprint=fingerprint))  # fmt: skip
        self.feeds.append(self.detail_feed)
        self.detail_feed.start()

    def stop_detail_tail(self) -> None:
        self.detail_screen = None
        feed, self.detail_feed = self.detail_feed, None
        if feed is not None:
            feed.cancel()

    # --- bindings: one registry -------------------------------------------------------

    def spec_allowed(self, spec: ActionSpec) -> bool:
        if spec.destructive and self.read_only:
            return False
        if spec.views and len(self.screen_stack) > 1:
            return False  # a screen (detail, help) is over the views
        return spec.applies_to(self.current_view)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        spec = ACTION_BY_NAME.get(action)
        if spec is None:
            return True
        return self.spec_allowed(spec)

    def on_key(self, event: events.Key) -> None:
        # --read-only hides destructive actions; pressing their key anyway says why nothing happens.
        spec = DESTRUCTIVE_KEYS.get(event.key)
        if spec is not None and self.read_only and spec.applies_to(self.current_view):
            event.stop()
            self.refuse_read_only(spec)

    def refuse_read_only(self, spec: ActionSpec) -> None:
        self.notify(
            f"{spec.description} is disabled: the console runs with --read-only.",
            title="read-only",
            severity="warning",
        )

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        for spec in ACTIONS:
            if not self.spec_allowed(spec):
                continue
            yield SystemCommand(
                f"{spec.description} ({spec.group.lower()})",
                spec.help,
                lambda action=spec.action: self.run_action(action),
            )
        yield from super().get_system_commands(screen)

    # --- general actions --------------------------------------------------------------

    def action_show_view(self, view_id: str) -> None:
        self.show_view(view_id)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.read_only))

    def open_prompt(self, mode: str, value: str = "") -> None:
        self.prompt_mode = mode
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = (
            "filter rows (enter keeps it, esc clears)" if mode == "filter"
            else "view: fleet top tail pools pins breaker hot (or quit)"
        )  # fmt: skip
        prompt.value = value
        prompt.add_class("visible")
        prompt.focus()

    def close_prompt(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.remove_class("visible")
        self.prompt_mode = ""
        tables = list(self.view().query(DataTable))
        if tables:
            tables[0].focus()

    def action_filter(self) -> None:
        self.open_prompt("filter", self.view().filter_text)

    def action_jump(self) -> None:
        self.open_prompt("jump")

    @on(Input.Changed, "#prompt")
    def _prompt_changed(self, event: Input.Changed) -> None:
        if self.prompt_mode == "filter":
            self.apply_filter(event.value)

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        mode, text = self.prompt_mode, event.value.strip()
        self.close_prompt()
        if mode == "jump" and text:
            if text.lower() in ("q", "q!", "quit", "exit"):
                self.exit()
                return
            view_id = view_for(text)
            if view_id is None:
                self.notify(f"no view named {text!r}", severity="warning")
            else:
                self.show_view(view_id)

    def on_descendant_blur(self, event: events.DescendantBlur) -> None:
        if event.widget.id == "prompt" and self.prompt_mode:
            self.query_one("#prompt", Input).remove_class("visible")
            self.prompt_mode = ""

    def cancel_prompt(self) -> None:
        """Escape in the prompt: a filter is cleared, a jump forgotten."""
        if self.prompt_mode == "filter":
            self.apply_filter("")
        self.close_prompt()

    def apply_filter(self, text: str) -> None:
        view = self.view()
        view.filter_text = text
        if isinstance(view, TailView):
            view.redraw()
        else:
            view.refresh_view()

    def action_toggle_pause(self) -> None:
        self.settings.paused = not self.settings.paused
        if not self.settings.paused:
            for poller in self.pollers.values():
                poller.wake()
            if self.tail_feed is not None and not self.tail_feed.running:
                self.tail_feed.start()
            if self.current_view == "tail":
                self.query_one(TailView).redraw()
        elif self.tail_feed is not None:
            self.tail_feed.cancel()
        self.update_topbar()
        if self.current_view == "tail":
            self.query_one(TailView).update_caption()
        self.notify("paused: nothing refreshes until p" if self.settings.paused else "resumed")

    def action_refresh_now(self) -> None:
        for poller in self.pollers.values():
            poller.wake()

    def action_refresh_rate(self, step: int) -> None:
        current = self.settings.interval
        idx = min(range(len(REFRESH_STEPS)), key=lambda i: abs(REFRESH_STEPS[i] - current))
        idx = max(0, min(len(REFRESH_STEPS) - 1, idx + step))
        self.settings.interval = REFRESH_STEPS[idx]
        self.update_topbar()
        self.notify(f"refreshing every {self.settings.interval:g}s")
        self.action_refresh_now()

    def screenshot_title(self) -> str:
        view_title = dict((v, t) for v, t, _ in VIEWS)[self.current_view]
        names = ", ".join(t.display for t in self.targets)
        return f"scry {view_title} · {names} · {fmt.stamp(self.clock.time(), self.tz)}"

    def save_view_screenshot(self, directory: Path, name: str | None = None) -> Path:
        """Write the screen as SVG (Textual's export), titled with view, targets and time."""
        directory.mkdir(parents=True, exist_ok=True)
        moment = dt.datetime.fromtimestamp(self.clock.time(), tz=self.tz)
        path = directory / (name or f"scry-{self.current_view}-{moment:%Y%m%d-%H%M%S}.svg")
        path.write_text(self.export_screenshot(title=self.screenshot_title()), encoding="utf-8")
        return path

    def action_screenshot(self) -> None:
        try:
            path = self.save_view_screenshot(self.screenshot_dir)
        except OSError as exc:
            self.notify(f"could not save the screenshot: {exc}", severity="error")
            return
        self.notify(f"saved {path}", title="screenshot")

    async def action_quit(self) -> None:
        self.exit()

    # --- Top --------------------------------------------------------------------------

    def action_cycle_sort(self) -> None:
        idx = SORTS.index(self.settings.top_by)
        self.settings.top_by = SORTS[(idx + 1) % len(SORTS)]
        self.notify(f"ranked by {SORT_LABELS[self.settings.top_by]}")
        self.view().refresh_view()
        self.action_refresh_now()

    def action_toggle_scope(self) -> None:
        names = [t.name for t in self.targets]
        self.top_scope = None if self.top_scope else names[0]
        self.view().refresh_view()

    def action_next_proxy(self) -> None:
        names = [t.name for t in self.targets]
        if self.top_scope is None:
            self.top_scope = names[0]
        else:
            self.top_scope = names[(names.index(self.top_scope) + 1) % len(names)]
        self.view().refresh_view()

    def action_open_detail(self) -> None:
        if self.current_view != "top":
            return
        row = self.query_one(TopView).selected()
        if row is not None:
            self.push_screen(DetailScreen(row))

    # --- Tail -------------------------------------------------------------------------

    def action_toggle_follow(self) -> None:
        self.query_one(TailView).toggle_follow()

    def action_toggle_errors(self) -> None:
        self.query_one(TailView).toggle_errors()

    def action_clear_tail(self) -> None:
        self.query_one(TailView).clear()

    # --- destructive actions (always confirmed; refused with --read-only) -----------------

    def confirm_then(
        self, spec_name: str, title: str, body: str | Text, verb: str, act: Callable[[], Any]
    ) -> None:
        spec = ACTION_BY_NAME[spec_name]
        if self.read_only:
            self.refuse_read_only(spec)
            return

        def done(confirmed: bool | None) -> None:
            if confirmed:
                self.run_worker(self._act(act), group="actions")
            else:
                self.notify("cancelled: nothing was changed")

        self.push_screen(ConfirmScreen(title, body, verb), done)

    async def _act(self, act: Callable[[], Any]) -> None:
        try:
            message = await act()
        except AdminError as exc:
            self.notify(str(exc), title="action failed", severity="error", timeout=8)
            return
        self.notify(message, title="done", timeout=6)
        self.action_refresh_now()

    def action_unpin(self) -> None:
        found = self.query_one(PinsView).selected() if self.current_view == "pins" else None
        if found is None:
            self.notify("select a pinned session first", severity="warning")
            return
        proxy, pin = found
        client = self.clients[proxy]
        if pin.replayable:
            what = (
                f"scry gives {pin.client_id}'s server back to the pool and replays its state "
                f"({', '.join(pin.reasons)}; {len(pin.statements)} statements) before its next query."
            )
        else:
            stuck = [r for r in pin.reasons if r not in ("set", "prepare")]
            what = (
                f"{pin.client_id} holds state that cannot be replayed ({', '.join(stuck)}): "
                "scry will refuse and say what would be lost; the client keeps its server."
            )
        body = Text.assemble(
            (f"{pin.database}/{pin.user}", "bold"), f"  {pin.application_name or ''}\n\n", what
        )

        async def act() -> str:
            result = await client.unpin(pin.client_id)
            if result.unpinned:
                return f"unpinned {pin.client_id} on {proxy}; replayed {len(result.replayed)} statements"
            return f"{pin.client_id} stays pinned: {result.reason or 'cannot replay ' + ', '.join(result.lost)}"

        self.confirm_then(
            "unpin", f"Force-unpin {pin.client_id} on {proxy}?", body, "Force-unpin", act
        )

    def action_kill_client(self) -> None:
        found = (
            self.query_one(PoolsView).selected_client() if self.current_view == "pools" else None
        )
        if found is None:
            self.notify("select a client in the Clients table first", severity="warning")
            return
        proxy, client_id = found
        client = self.clients[proxy]
        body = (
            f"scry disconnects {client_id} with FATAL 57P01 (terminated by administrator); "
            "its transaction, if any, is rolled back."
        )

        async def act() -> str:
            result = await client.kill(client_id)
            return (
                f"killed {client_id} on {proxy}"
                if result.killed
                else f"{client_id} was already gone"
            )

        self.confirm_then(
            "kill_client", f"Disconnect client {client_id} on {proxy}?", body, "Kill", act
        )

    def _breaker_target(self) -> tuple[str, str] | None:
        found = self.query_one(BreakerView).selected() if self.current_view == "breaker" else None
        if found is None:
            self.notify("select a database first", severity="warning")
            return None
        proxy, entry = found
        return proxy, entry.database

    def action_trip(self) -> None:
        target = self._breaker_target()
        if target is None:
            return
        proxy, database = target
        client = self.clients[proxy]
        body = (
            f"scry opens the circuit breaker of {database} and holds it open until reset: "
            "new queries fail fast with SQLSTATE 57P03 'tripped from the scry console'."
        )

        async def act() -> str:
            result = await client.trip(database=database, reason="tripped from the scry console")
            return f"breaker of {database} on {proxy}: {'opened' if result.changed else 'already open'}"

        self.confirm_then("trip", f"Trip the breaker of {database} on {proxy}?", body, "Trip", act)

    def action_reset(self) -> None:
        target = self._breaker_target()
        if target is None:
            return
        proxy, database = target
        client = self.clients[proxy]
        body = f"scry closes the circuit breaker of {database}: queries reach PostgreSQL again."

        async def act() -> str:
            result = await client.reset(database=database)
            return f"breaker of {database} on {proxy}: {'closed' if result.changed else 'already closed'}"

        self.confirm_then(
            "reset", f"Reset the breaker of {database} on {proxy}?", body, "Reset", act
        )

    # --- shutdown ---------------------------------------------------------------------

    async def close_resources(self) -> None:
        """Stop streams, close HTTP clients and SSH tunnels (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for feed in self.feeds:
            await feed.stop()
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        await asyncio.gather(*(t.close() for t in self.tunnels.values()), return_exceptions=True)

    async def on_unmount(self) -> None:
        await self.close_resources()
