"""Screens over the views: help (built from the action registry), confirm, fingerprint detail."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rich.console import Group
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, RichLog, Static

from admin import TailEvent
from scry_tui import fmt
from scry_tui.actions import ACTIONS, display_keys
from scry_tui.model import TopRow
from scry_tui.views.tail import event_line

if TYPE_CHECKING:
    from scry_tui.app import ScryConsole


class HelpScreen(ModalScreen[None]):
    """Every key, generated from the registry (nothing here is written by hand)."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close", id="help.close")]

    def __init__(self, read_only: bool) -> None:
        super().__init__()
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", justify="right")
        table.add_column()
        table.add_column(style="dim")
        groups: dict[str, list[object]] = {}
        for spec in ACTIONS:
            groups.setdefault(spec.group, []).append(spec)
        for group, specs in groups.items():
            table.add_row("", Text(group, style="bold underline"), "")
            for spec in specs:
                where = ", ".join(spec.views) if spec.views else ""  # type: ignore[attr-defined]
                help_text = Text(spec.help)  # type: ignore[attr-defined]
                if spec.destructive:  # type: ignore[attr-defined]
                    help_text.append(
                        "  (disabled: --read-only)" if self.read_only else "  (asks first)",
                        style="bold red" if self.read_only else "yellow",
                    )
                table.add_row(display_keys(spec), help_text, where)  # type: ignore[arg-type]
        notes = Text.assemble(
            ("\nIn tables: ", "bold"),
            "↑/↓ move, ⏎ opens, tab switches table.  ",
            ("Palette: ", "bold"),
            "ctrl+p runs any action by name.",
        )
        with VerticalScroll(id="help-box"):
            yield Static(Text("scry console — keys", style="bold"), classes="title")
            yield Static(Group(table, notes))


class ConfirmScreen(ModalScreen[bool]):
    """Asks before a destructive action, naming exactly what it will do. Cancel is the default."""

    BINDINGS = [
        Binding("y", "confirm", "Yes", id="confirm.yes"),
        Binding("n,escape", "cancel", "No", id="confirm.no"),
    ]

    def __init__(self, title: str, body: str | Text, verb: str) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.verb = verb

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(Text(self.title_text, style="bold"), classes="title")
            yield Static(self.body, id="confirm-body")
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel (n)", id="cancel", variant="default")
                yield Button(f"{self.verb} (y)", id="confirm", variant="error")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


def timeline_bar(queue: float, acquire: float, backend: float, width: int = 50) -> Text:
    """A stacked bar of where a query's time went: queue, pool acquire, backend, other."""
    total = queue + acquire + backend
    if total <= 0:
        return Text("no timing yet", style="dim")
    text = Text()
    for value, style in ((queue, "yellow"), (acquire, "magenta"), (backend, "green")):
        cells = int(round(value / total * width))
        text.append("█" * cells, style=style)
    text.append("\n")
    text.append("■ queue ", style="yellow")
    text.append(f"{fmt.ms(queue)} ms  ")
    text.append("■ acquire ", style="magenta")
    text.append(f"{fmt.ms(acquire)} ms  ")
    text.append("■ backend ", style="green")
    text.append(f"{fmt.ms(backend)} ms")
    return text


class DetailScreen(Screen[None]):
    """One fingerprint: its text, where its time goes, its latency, and a live tail of it."""

    BINDINGS = [
        Binding("escape,q", "dismiss", "Back", id="detail.back"),
        Binding("ctrl+s", "app.screenshot", "Screenshot", show=False, id="detail.screenshot"),
    ]

    def __init__(self, row: TopRow) -> None:
        super().__init__()
        self.row = row
        self.samples: deque[TailEvent] = deque(maxlen=1000)

    @property
    def console(self) -> ScryConsole:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        q = self.row.query
        with Vertical(id="detail"):
            yield Static(self.header(), id="detail-header")
            yield Static(
                Syntax(q.query, "sql", theme="monokai", word_wrap=True, background_color="default"),
                id="detail-sql",
            )
            with Horizontal(id="detail-stats"):
                yield Static("", id="detail-timeline")
                yield Static("", id="detail-histogram")
            yield Static(Text("Live tail of this fingerprint", style="bold"), classes="section")
            yield RichLog(id="detail-tail", max_lines=500, wrap=False, auto_scroll=True)
        yield Footer()

    def header(self) -> Text:
        q = self.row.query
        text = Text.assemble(
            ("fingerprint ", "dim"), (q.fingerprint, "bold cyan"),
            ("   calls ", "dim"), fmt.count(q.calls),
            ("   errors ", "dim"), (fmt.count(q.errors), "bold red" if q.errors else ""),
            ("   rows ", "dim"), fmt.count(q.rows),
            ("   share of time ", "dim"), (fmt.percent(q.share), "bold"),
        )  # fmt: skip
        if self.row.proxies:
            text.append(f"   on {', '.join(self.row.proxies)}", style="dim")
        return text

    def on_mount(self) -> None:
        self.update_stats()
        self.console.start_detail_tail(self)

    def on_unmount(self) -> None:
        self.console.stop_detail_tail()

    def add_event(self, proxy: str, event: TailEvent) -> None:
        self.samples.append(event)
        multi = len(self.console.states) > 1
        log = self.query_one("#detail-tail", RichLog)
        log.write(
            event_line(proxy if multi else None, event, self.console.tz),
            width=max(log.scrollable_content_region.width, self.app.size.width - 6, 40),
        )
        self.update_stats()

    def update_stats(self) -> None:
        q = self.row.query
        if self.samples:
            n = len(self.samples)
            queue = sum(e.queue_us for e in self.samples) / n / 1000
            acquire = sum(e.pool_acquire_us for e in self.samples) / n / 1000
            backend = sum(e.backend_us for e in self.samples) / n / 1000
            source = f"mean of the last {n} events"
        else:
            queue, backend = q.queue_ms_mean, q.backend_ms_mean
            acquire = max(0.0, q.total_ms_mean - queue - backend)
            source = "means since start (no live events yet)"
        timeline = Text.assemble(("Timeline ", "bold"), (source, "dim"), "\n")
        timeline.append_text(timeline_bar(queue, acquire, backend))
        timeline.append("\n\n")
        ladder = Table.grid(padding=(0, 1))
        for _ in range(6):
            ladder.add_column(justify="right")
        ladder.add_row(*(Text(s, style="dim") for s in ("min", "p50", "mean", "p95", "p99", "max")))
        ladder.add_row(*(fmt.ms(v) for v in (q.min_ms, q.p50_ms, q.mean_ms, q.p95_ms, q.p99_ms, q.max_ms)))  # fmt: skip
        self.query_one("#detail-timeline", Static).update(Group(timeline, Text("Latency ms", style="bold"), ladder))  # fmt: skip
        self.query_one("#detail-histogram", Static).update(self.histogram())

    def histogram(self) -> Text:
        text = Text("Latency histogram ", style="bold")
        values = [e.total_us / 1000 for e in self.samples]
        if not values:
            text.append("(waiting for live events)", style="dim")
            return text
        text.append(f"({len(values)} events)", style="dim")
        buckets = fmt.histogram(values)
        top = max(c for _, c in buckets) or 1
        for label, c in buckets:
            text.append(f"\n{label:>8} ")
            text.append(fmt.bar(c / top, 24), style="cyan")
            text.append(f" {c}", style="dim")
        return text
