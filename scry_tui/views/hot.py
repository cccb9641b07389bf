"""Hot data: the tables and (hashed) values queries touch most, estimated counts."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label

from scry_tui import fmt
from scry_tui.views.base import ConsoleTable, Row, View, matches, row_key, sync_table


class HotView(View):
    view_id = "hot"
    title = "Hot"

    def compose(self) -> ComposeResult:
        yield self.caption()
        with Horizontal(id="hot-split"):
            with Vertical():
                yield Label("Tables", classes="section")
                tables: ConsoleTable = ConsoleTable(id="hot-tables", cursor_type="row")
                for name in ("table", "est. count", "share"):
                    tables.add_column(name, key=name)
                yield tables
            with Vertical():
                yield Label("Values (keyed hashes, never the values)", classes="section")
                values: ConsoleTable = ConsoleTable(id="hot-values", cursor_type="row")
                for name in ("column", "value", "est. count", "share"):
                    values.add_column(name, key=name)
                yield values

    def refresh_view(self) -> None:
        # Merge over the fleet: estimated counts add up.
        table_counts: dict[str, float] = defaultdict(float)
        value_counts: dict[tuple[str, str], float] = defaultdict(float)
        for state in self.states:
            if not state.up or state.hot is None:
                continue
            for t in state.hot.tables:
                table_counts[t.table] += t.count
            for v in state.hot.values:
                value_counts[(v.column, v.value)] += v.count
        t_total = sum(table_counts.values()) or 1.0
        v_total = sum(value_counts.values()) or 1.0
        t_rows: list[Row] = [
            (
                name,
                [
                    Text(name, style="bold"),
                    fmt.count(n),
                    Text.assemble(
                        (fmt.bar(n / t_total, 10), "cyan"), f" {fmt.percent(n / t_total)}"
                    ),
                ],
            )  # fmt: skip
            for name, n in sorted(table_counts.items(), key=lambda kv: (-kv[1], kv[0]))
            if matches(self.filter_text, name)
        ]
        v_rows: list[Row] = [
            (
                row_key(col, val),
                [
                    col,
                    Text(val[:16], style="magenta"),
                    fmt.count(n),
                    Text.assemble(
                        (fmt.bar(n / v_total, 10), "magenta"), f" {fmt.percent(n / v_total)}"
                    ),
                ],
            )  # fmt: skip
            for (col, val), n in sorted(value_counts.items(), key=lambda kv: (-kv[1], kv[0]))
            if matches(self.filter_text, col, val)
        ]
        sync_table(self.query_one("#hot-tables", DataTable), t_rows)
        sync_table(self.query_one("#hot-values", DataTable), v_rows)
        parts: list[str | Text | tuple[str, str]] = [
            ("Hot data ", "bold"),
            f"{len(t_rows)} tables · {len(v_rows)} values",
            ("  ·  counts are sketch estimates", "dim"),
        ]
        self.set_caption_with_gaps(*parts)
