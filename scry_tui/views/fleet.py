"""Fleet: one row per proxy — is it up, how busy, how fast, is anything wrong."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from scry_tui import fmt
from scry_tui.model import ProxyState
from scry_tui.views.base import ConsoleTable, Row, View, matches, selected_key, sync_table

COLUMNS = (
    "proxy", "status", "mode", "workers", "clients", "servers", "waiting", "saturation",
    "qps", "qps trend", "p99 ms", "p99 trend", "breaker", "signals",
)  # fmt: skip


class FleetView(View):
    view_id = "fleet"
    title = "Fleet"

    def compose(self) -> ComposeResult:
        yield self.caption()
        table: ConsoleTable = ConsoleTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
        for name in COLUMNS:
            table.add_column(name, key=name)
        yield table
        yield Static("", id="fleet-detail", classes="detail", markup=False)

    def row_for(self, state: ProxyState, now: float) -> Row:
        status = self.console.status_text(state)
        if state.status is None or not state.up:
            cells: list[object] = [Text(state.name, style="bold"), status]
            cells += [Text("–", style="dim")] * (len(COLUMNS) - 2)
            return state.name, cells
        s = state.status
        sat = state.saturation()
        signals = state.signals()
        sig_text = Text()
        for i, (db, name, severity) in enumerate(signals):
            if i:
                sig_text.append(", ")
            sig_text.append(f"{name}", style=fmt.severity_style(severity))
            if len({d for d, _, _ in signals}) > 1:
                sig_text.append(f"@{db}", style="dim")
        if not signals:
            sig_text = Text("none", style="dim")
        sat_text = (
            Text.assemble((fmt.bar(sat, 8), fmt.saturation_style(sat)), f" {fmt.percent(sat)}")
            if sat is not None
            else Text("–", style="dim")
        )
        p99 = s.queries.window_p99_ms
        cells = [
            Text(state.name, style="bold"),
            status,
            s.pool_mode,
            str(s.workers),
            fmt.count(s.clients),
            fmt.count(s.servers),
            Text(str(s.waiting), style="bold yellow" if s.waiting else "dim"),
            sat_text,
            fmt.rate(s.queries.qps),
            Text(fmt.sparkline(state.qps_history), style="cyan"),
            fmt.ms(p99),
            Text(fmt.sparkline(state.p99_history), style="magenta"),
            fmt.breaker_text(state.breaker_state()),
            sig_text,
        ]
        return state.name, cells

    def refresh_view(self) -> None:
        now = self.console.clock.time()
        states = self.states
        rows = [
            self.row_for(s, now)
            for s in states
            if matches(self.filter_text, s.name, s.display, s.status and s.status.pool_mode)
        ]
        table = self.query_one("#fleet-table", DataTable)
        sync_table(table, rows)
        up = sum(1 for s in states if s.up)
        qps = sum(s.status.queries.qps for s in states if s.up and s.status)
        self.set_caption(
            ("Fleet ", "bold"),
            (f"{up}/{len(states)} up", "green" if up == len(states) else "bold red"),
            ("  ·  ", "dim"),
            f"{fmt.rate(qps)} q/s total",
        )
        self.show_detail(selected_key(table))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail(event.row_key.value if event.row_key else None)

    def show_detail(self, name: str | None) -> None:
        detail = self.query_one("#fleet-detail", Static)
        state = self.console.states.get(name or "")
        if state is None:
            detail.update("")
            return
        text = Text()
        text.append(f"{state.name}", style="bold")
        text.append(f"  {state.display}", style="dim")
        if state.unreachable_since is not None:
            text.append(f"\n✖ {state.last_error}", style="red")
            if state.retry_in:
                text.append(f"  (retrying every {state.retry_in:.0f}s)", style="dim")
        if state.status is not None:
            s = state.status
            text.append(f"\nscry {s.version}  pid {s.pid}  ", style="")
            text.append(f"listening on {', '.join(s.listen_addresses) or s.listen_addr}")
            text.append(f"  admin {s.admin_addr}", style="dim")
            text.append(f"\ndatabases: {', '.join(s.databases) or '–'}")
            text.append(f"  queries {fmt.count(s.queries.queries)}")
            text.append(f"  errors {fmt.count(s.queries.errors)}")
            text.append(f"  fingerprints {fmt.count(s.queries.fingerprints)}")
            if s.workers > 1:
                text.append(
                    f"\n{s.workers} workers; figures are the instance's totals "
                    "(worker 0 merges them)",
                    style="yellow",
                )
            if s.read_only:
                text.append("\nadmin API is read-only", style="yellow")
        for db, name, severity in state.signals():
            text.append(f"\n⚠ {db}: {name}", style=fmt.severity_style(severity))
        detail.update(text)
