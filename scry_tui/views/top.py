"""Top: fingerprints ranked by total time (or mean, calls, errors, p99).

With several proxies the ranking is merged by fingerprint id (``m`` switches
to one proxy; ``n`` picks the next). ↑/↓ next to a rank or a latency say how
it moved since the previous refresh.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from scry_tui import fmt
from scry_tui.model import SORT_LABELS, TopRow, top_fetch_limit, top_rows
from scry_tui.views.base import ConsoleTable, Row, View, matches, sync_table

COLUMNS = (
    ("#", "rank"), ("Δ", "delta"), ("fingerprint", "fingerprint"), ("calls", "calls"),
    ("calls/s", "rate"), ("mean ms", "mean"), ("p95 ms", "p95"), ("p99 ms", "p99"),
    ("rows", "rows"), ("errors", "errors"), ("total s", "total"), ("share", "share"),
    ("query", "query"),
)  # fmt: skip
QUERY_WIDTH = 60


class TopView(View):
    view_id = "top"
    title = "Top"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.ranks: dict[str, int] = {}
        self.prev_ranks: dict[str, int] = {}
        self._generation: tuple[int, ...] = ()
        self.rows: dict[str, TopRow] = {}

    def compose(self) -> ComposeResult:
        yield self.caption()
        table: ConsoleTable = ConsoleTable(id="top-table", cursor_type="row", zebra_stripes=True)
        for label, key in COLUMNS:
            table.add_column(label, key=key)
        yield table

    def scoped_states(self) -> list:  # type: ignore[type-arg]
        scope = self.console.top_scope
        states = self.states
        if scope is None:
            return states
        return [s for s in states if s.name == scope]

    def refresh_view(self) -> None:
        states = self.scoped_states()
        by = self.console.settings.top_by
        generation = tuple(s.polls for s in states) + (hash(by),)
        if generation != self._generation:
            # New data: what was the ranking a refresh ago?
            self.prev_ranks, self._generation = self.ranks, generation
        settings = self.console.settings
        rows = top_rows(states, by, self.prev_ranks, settings.top_shown)
        if self.console.top_scope is None:
            settings.top_limit = top_fetch_limit(states, by, settings.top_shown, settings.top_limit)
        self.ranks = {r.query.fingerprint: i for i, r in enumerate(rows, start=1)}
        self.rows = {r.query.fingerprint: r for r in rows}
        table_rows: list[Row] = []
        for rank, row in enumerate(rows, start=1):
            q = row.query
            if not matches(self.filter_text, q.fingerprint, q.query):
                continue
            table_rows.append((q.fingerprint, self.cells(rank, row)))
        sync_table(self.query_one("#top-table", DataTable), table_rows)
        scope = self.console.top_scope
        live = [s for s in states if s.up and s.top is not None]
        where = (
            f"proxy {scope}"
            if scope
            else (f"fleet: {len(live)} proxies merged by fingerprint" if len(live) > 1 else
                  (live[0].name if live else "no proxy answering"))
        )  # fmt: skip
        parts: list[str | Text | tuple[str, str]] = [
            ("Top ", "bold"),
            ("ranked by ", "dim"),
            (SORT_LABELS[by], "bold cyan"),
            ("  ·  ", "dim"),
            where,
            ("  ·  ", "dim"),
            f"{len(rows)} fingerprints",
        ]
        self.set_caption_with_gaps(*parts)

    def cells(self, rank: int, row: TopRow) -> list[object]:
        q = row.query
        share_style = "bold red" if q.share >= 0.3 else "yellow" if q.share >= 0.1 else "green"
        return [
            Text(str(rank), style="bold"),
            fmt.rank_change(row.prev_rank, rank) if self.prev_ranks else Text(" "),
            Text(q.fingerprint[:12], style="cyan"),
            fmt.count(q.calls),
            fmt.rate(row.calls_per_s),
            Text.assemble(fmt.ms(q.mean_ms), " ", fmt.delta_arrow(row.prev_mean, q.mean_ms)),
            fmt.ms(q.p95_ms),
            Text.assemble(fmt.ms(q.p99_ms), " ", fmt.delta_arrow(row.prev_p99, q.p99_ms)),
            fmt.count(q.rows),
            Text(fmt.count(q.errors), style="bold red" if q.errors else "dim"),
            f"{q.total_ms / 1000:,.2f}",
            Text.assemble((fmt.bar(q.share, 6), share_style), f" {fmt.percent(q.share)}"),
            fmt.shorten(q.query, QUERY_WIDTH),
        ]

    def selected(self) -> TopRow | None:
        from scry_tui.views.base import selected_key

        key = selected_key(self.query_one("#top-table", DataTable))
        return self.rows.get(key) if key else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.console.action_open_detail()
