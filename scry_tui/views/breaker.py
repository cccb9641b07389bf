"""Breaker and health: per database, the breaker's state, counters, transitions and signals."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from admin import BreakerEntry
from scry_tui import fmt
from scry_tui.views.base import ConsoleTable, Row, View, matches, row_key, selected_key, sync_table

COLUMNS = (
    "proxy", "database", "state", "retry in", "failures", "rejections",
    "opened", "qps", "error rate", "p99 ms", "baseline p99", "saturation", "signals",
)  # fmt: skip


class BreakerView(View):
    view_id = "breaker"
    title = "Breaker"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.entries: dict[str, tuple[str, BreakerEntry]] = {}

    def compose(self) -> ComposeResult:
        yield self.caption()
        table: ConsoleTable = ConsoleTable(
            id="breaker-table", cursor_type="row", zebra_stripes=True
        )
        for name in COLUMNS:
            table.add_column(name, key=name)
        yield table
        yield Static("", id="breaker-detail", classes="detail", markup=False)

    def refresh_view(self) -> None:
        rows: list[Row] = []
        self.entries = {}
        for state in self.states:
            if not state.up or state.breaker is None:
                continue
            for e in state.breaker.databases:
                b, h = e.breaker, e.health
                if not matches(self.filter_text, state.name, e.database, b.state,
                               *(s.name for s in h.signals)):  # fmt: skip
                    continue
                key = row_key(state.name, e.database)
                self.entries[key] = (state.name, e)
                sig = Text(", ".join(s.name for s in h.signals) or "none",
                           style=fmt.severity_style(h.signals[0].severity) if h.signals else "dim")  # fmt: skip
                err = h.window.error_rate
                rows.append(
                    (
                        key,
                        [
                            state.name, Text(e.database, style="bold"),
                            fmt.breaker_text(b.state) + (Text(" (held)", style="red") if b.held else Text("")),
                            f"{b.retry_in_seconds:.0f}s" if b.retry_in_seconds is not None else "–",
                            Text(str(b.counters.failures), style="red" if b.counters.failures else "dim"),
                            Text(str(b.counters.rejections), style="bold red" if b.counters.rejections else "dim"),
                            str(b.counters.opened),
                            fmt.rate(h.window.qps),
                            Text(fmt.percent(err), style="red" if err else "dim"),
                            fmt.ms(h.window.p99), fmt.ms(h.baseline.p99),
                            Text.assemble((fmt.bar(h.pool.saturation, 6), fmt.saturation_style(h.pool.saturation)),
                                          f" {fmt.percent(h.pool.saturation)}"),
                            sig,
                        ],
                    )
                )  # fmt: skip
        table = self.query_one("#breaker-table", DataTable)
        sync_table(table, rows)
        opened = sum(1 for _, e in self.entries.values() if e.breaker.state != "closed")
        parts: list[str | Text | tuple[str, str]] = [
            ("Breaker & health ", "bold"),
            f"{len(rows)} databases",
            ("  ·  ", "dim"),
            (f"{opened} not closed", "bold red" if opened else "green"),
        ]
        self.set_caption_with_gaps(*parts)
        self.show_detail(selected_key(table))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail(event.row_key.value if event.row_key else None)

    def show_detail(self, key: str | None) -> None:
        detail = self.query_one("#breaker-detail", Static)
        found = self.entries.get(key or "")
        if found is None:
            detail.update("")
            return
        proxy, e = found
        b, h = e.breaker, e.health
        tz = self.console.tz
        text = Text.assemble(
            (e.database, "bold"), (f" on {proxy}  ", "dim"), fmt.breaker_text(b.state)
        )
        if b.open_reason:
            text.append(f"  reason: {b.open_reason}", style="red")
        c = b.config
        text.append(
            f"\n  trips after {c.failure_threshold} failures, closes after {c.success_threshold} "
            f"successes, retries after {c.timeout_seconds:.0f}s",
            style="dim",
        )
        if b.last_failure_reason:
            text.append(f"\n  last failure: {b.last_failure_reason}", style="red")
        for s in h.signals:
            text.append(f"\n  ⚠ {s.name}", style=fmt.severity_style(s.severity))
            text.append(f"  {s.message} (for {fmt.duration(s.for_seconds)})")
        if b.transitions:
            text.append("\n  transitions:", style="dim")
            for t in b.transitions[-5:]:
                text.append(f"\n    {fmt.clock(t.at, tz)}  {t.from_} → {t.to}  ", style="")
                text.append(t.reason, style="dim")
        detail.update(text)

    def selected(self) -> tuple[str, BreakerEntry] | None:
        key = selected_key(self.query_one("#breaker-table", DataTable))
        return self.entries.get(key) if key else None
