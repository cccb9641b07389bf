"""Pins: sessions holding a server in hybrid mode, why, and whether force-unpin can replay them."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from admin import PinInfo
from scry_tui import fmt
from scry_tui.views.base import (
    ConsoleTable,
    Row,
    View,
    matches,
    row_key,
    selected_key,
    split_key,
    sync_table,
)

COLUMNS = (
    "proxy", "client", "db/user", "app", "reasons", "replayable", "since", "pinned for",
    "server", "pid",
)  # fmt: skip
REPLAYABLE_REASONS = {"set", "prepare"}


def reasons_text(reasons: list[str]) -> Text:
    text = Text()
    for i, reason in enumerate(reasons):
        if i:
            text.append(",")
        text.append(reason, style="green" if reason in REPLAYABLE_REASONS else "bold yellow")
    return text


class PinsView(View):
    view_id = "pins"
    title = "Pins"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.pins: dict[str, tuple[str, PinInfo]] = {}

    def compose(self) -> ComposeResult:
        yield self.caption()
        table: ConsoleTable = ConsoleTable(id="pins-table", cursor_type="row", zebra_stripes=True)
        for name in COLUMNS:
            table.add_column(name, key=name)
        yield table
        yield Static("", id="pins-detail", classes="detail", markup=False)

    def refresh_view(self) -> None:
        rows: list[Row] = []
        self.pins = {}
        tz = self.console.tz
        for state in self.states:
            if not state.up or state.pins is None:
                continue
            for p in state.pins.pins:
                if not matches(self.filter_text, state.name, p.client_id, p.database, p.user,
                               p.application_name, *p.reasons):  # fmt: skip
                    continue
                key = row_key(state.name, p.client_id)
                self.pins[key] = (state.name, p)
                server = p.server_id or ("reclaimed (replay pending)" if p.replay_pending else "–")
                rows.append(
                    (
                        key,
                        [
                            state.name, Text(p.client_id, style="cyan"), f"{p.database}/{p.user}",
                            fmt.shorten(p.application_name, 16), reasons_text(p.reasons),
                            Text("✓ yes", style="green") if p.replayable else Text("✗ no", style="bold yellow"),
                            fmt.clock(p.since, tz), fmt.duration(p.pinned_s), server,
                            str(p.backend_pid) if p.backend_pid else "–",
                        ],
                    )
                )  # fmt: skip
        table = self.query_one("#pins-table", DataTable)
        sync_table(table, rows)
        stuck = sum(1 for _, p in self.pins.values() if not p.replayable)
        parts: list[str | Text | tuple[str, str]] = [
            ("Pins ", "bold"),
            f"{len(rows)} pinned sessions",
            ("  ·  ", "dim"),
            (f"{stuck} not replayable", "bold yellow" if stuck else "dim"),
        ]
        self.set_caption_with_gaps(*parts)
        self.show_detail(selected_key(table))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail(event.row_key.value if event.row_key else None)

    def show_detail(self, key: str | None) -> None:
        detail = self.query_one("#pins-detail", Static)
        found = self.pins.get(key or "")
        if found is None:
            detail.update(Text("No pinned session selected.", style="dim") if not self.pins else "")
            return
        proxy, p = found
        text = Text.assemble((f"{p.client_id}", "bold cyan"), (f" on {proxy}", "dim"))
        for reason, statement in p.pinned_by.items():
            text.append(
                f"\n  {reason:<13}", style="green" if reason in REPLAYABLE_REASONS else "yellow"
            )
            text.append(fmt.shorten(statement, 90))
        if p.settings:
            text.append("\n  settings     ", style="dim")
            text.append(", ".join(p.settings))
        if p.statements:
            text.append(f"\n  replay       {len(p.statements)} statements", style="dim")
        text.append(
            "\n  force-unpin: "
            + ("replays the session's state on its next server" if p.replayable
               else "cannot replay " + ", ".join(r for r in p.reasons if r not in REPLAYABLE_REASONS)),
            style="green" if p.replayable else "yellow",
        )  # fmt: skip
        detail.update(text)

    def selected(self) -> tuple[str, PinInfo] | None:
        key = selected_key(self.query_one("#pins-table", DataTable))
        return self.pins.get(key) if key else None


def pin_key_parts(key: str) -> list[str]:
    return split_key(key)
