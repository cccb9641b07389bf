"""Tail: the live, anonymized query stream, following the end (Toolong-style).

``f`` stops following so you can read (events keep arriving, counted in the
caption); ``p`` pauses the whole console; ``/`` filters what is shown
(fingerprint, text, client, database, SQLSTATE); ``e`` keeps only errors.
Failed statements are red with their SQLSTATE.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import RichLog

from admin import TailEvent
from scry_tui import fmt
from scry_tui.views.base import View, matches

BUFFER = 5000


def event_line(proxy: str | None, e: TailEvent, tz: object, width: int = 200) -> Text:
    """One event as a line: time, [proxy], client, db, latency, rows, status, fp, query."""
    total_ms = e.total_us / 1000
    lat_style = "bold red" if total_ms >= 500 else "yellow" if total_ms >= 50 else "green"
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(fmt.clock(e.ts, tz, millis=True), style="dim")  # type: ignore[arg-type]
    if proxy:
        line.append(f" {proxy:<10.10}", style="blue")
    line.append(f" {e.client_id:>6.6}", style="cyan")
    line.append(f" {e.database:<8.8}")
    line.append(f" {fmt.ms(total_ms):>7}ms", style=lat_style)
    line.append(f" {fmt.count(e.rows):>6}r", style="dim")
    if e.sqlstate:
        line.append(f" {e.sqlstate:>5}", style="bold white on red")
    else:
        line.append("    ok", style="green")
    line.append(f" {e.fingerprint[:8]}", style="magenta")
    line.append(" " + fmt.shorten(e.query, width), style="red" if e.sqlstate else "")
    if e.pinned:
        line.append(f"  📌{','.join(e.pin_reasons)}", style="yellow")
    return line


def event_matches(filter_text: str, proxy: str, e: TailEvent) -> bool:
    return matches(
        filter_text, proxy, e.client_id, e.database, e.user, e.application_name,
        e.fingerprint, e.query, e.sqlstate,
    )  # fmt: skip


class TailView(View):
    view_id = "tail"
    title = "Tail"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.events: deque[tuple[str, TailEvent]] = deque(maxlen=BUFFER)
        self.following = True
        self.errors_only = False
        self.unseen = 0
        self.total = 0
        self.errors = 0
        self.notices: deque[str] = deque(maxlen=3)

    def compose(self) -> ComposeResult:
        yield self.caption()
        yield RichLog(id="tail-log", max_lines=BUFFER, wrap=False, auto_scroll=True, markup=False)

    @property
    def log_widget(self) -> RichLog:
        return self.query_one("#tail-log", RichLog)

    def shown(self, proxy: str, e: TailEvent) -> bool:
        if self.errors_only and not e.sqlstate:
            return False
        return event_matches(self.filter_text, proxy, e)

    def add_event(self, proxy: str, e: TailEvent) -> None:
        self.events.append((proxy, e))
        self.total += 1
        if e.sqlstate:
            self.errors += 1
        if not self.shown(proxy, e):
            return
        if self.following and not self.console.settings.paused:
            self.log_widget.write(self.line(proxy, e), width=self.line_width(), scroll_end=True)
        else:
            self.unseen += 1
        self.update_caption()

    def line_width(self) -> int:
        # While the view is being switched in, the log's own region can still be
        # 0 wide; the screen's width is the better guess then.
        return max(self.log_widget.scrollable_content_region.width, self.app.size.width - 4, 40)

    def line(self, proxy: str, e: TailEvent) -> Text:
        return event_line(proxy if self.multi() else None, e, self.console.tz)

    def redraw(self) -> None:
        """Rewrite the log from the buffer (after a filter or follow change)."""
        log = self.log_widget
        log.clear()
        for proxy, e in self.events:
            if self.shown(proxy, e):
                log.write(self.line(proxy, e), width=self.line_width(), scroll_end=self.following)
        self.unseen = 0
        self.update_caption()

    def refresh_view(self) -> None:
        self.update_caption()

    def add_notice(self, proxy: str, text: str) -> None:
        self.notices.append(f"{proxy}: {text}")
        self.update_caption()

    def update_caption(self) -> None:
        paused = self.console.settings.paused
        mode: tuple[str, str]
        if paused:
            mode = ("⏸ paused", "bold yellow")
        elif self.following:
            mode = ("▶ following", "bold green")
        else:
            mode = ("⏹ not following", "bold yellow")
        parts: list[str | Text | tuple[str, str]] = [
            ("Tail ", "bold"),
            mode,
            ("  ·  ", "dim"),
            f"{fmt.count(self.total)} events",
            ("  ·  ", "dim"),
            (f"{fmt.count(self.errors)} errors", "red" if self.errors else "dim"),
        ]
        if self.unseen:
            parts += [("  ·  ", "dim"), (f"{self.unseen} new below (f to follow)", "yellow")]
        if self.errors_only:
            parts += [("  ·  ", "dim"), ("errors only", "bold red")]
        if self.notices:
            parts += [("  ·  ", "dim"), (self.notices[-1], "yellow")]
        self.set_caption(*parts)

    def toggle_follow(self) -> None:
        self.following = not self.following
        self.log_widget.auto_scroll = self.following
        if self.following:
            self.redraw()
        else:
            self.update_caption()

    def toggle_errors(self) -> None:
        self.errors_only = not self.errors_only
        self.redraw()

    def clear(self) -> None:
        self.events.clear()
        self.total = self.errors = self.unseen = 0
        self.redraw()
