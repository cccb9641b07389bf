"""Pools, and the clients and servers behind them (PgBouncer's SHOW POOLS/CLIENTS/SERVERS)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label

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

POOL_COLUMNS = (
    "proxy", "database", "user", "mode", "size", "servers", "active", "idle", "parked",
    "waiting", "max wait ms", "pinned", "saturation", "breaker",
)  # fmt: skip
CLIENT_COLUMNS = (
    "proxy",
    "client",
    "addr",
    "db/user",
    "app",
    "state",
    "server",
    "running",
    "query",
)
SERVER_COLUMNS = ("proxy", "server", "db/user", "state", "client", "pid", "tx", "age", "idle")

STATE_STYLES = {
    "active": "bold green",
    "waiting": "bold yellow",
    "idle_in_transaction": "yellow",
    "idle": "dim",
    "closed": "dim red",
}


def _table(table_id: str, columns: tuple[str, ...]) -> DataTable[object]:
    table: ConsoleTable = ConsoleTable(id=table_id, cursor_type="row", zebra_stripes=True)
    for name in columns:
        table.add_column(name, key=name)
    return table


class PoolsView(View):
    view_id = "pools"
    title = "Pools"

    def compose(self) -> ComposeResult:
        yield self.caption()
        yield _table("pools-table", POOL_COLUMNS)
        with Horizontal(id="pools-lower"):
            with Vertical():
                yield Label("Clients", classes="section")
                yield _table("clients-table", CLIENT_COLUMNS)
            with Vertical():
                yield Label("Servers", classes="section")
                yield _table("servers-table", SERVER_COLUMNS)

    def refresh_view(self) -> None:
        f = self.filter_text
        pools: list[Row] = []
        clients: list[Row] = []
        servers: list[Row] = []
        for state in self.states:
            if not state.up:
                continue
            for p in state.pools.pools if state.pools else []:
                if not matches(f, state.name, p.database, p.user, p.mode):
                    continue
                sat = (p.active + p.pinned) / p.size if p.size else None
                pools.append(
                    (
                        row_key(state.name, p.database, p.user),
                        [
                            state.name, p.database, p.user, p.mode, str(p.size), str(p.servers),
                            Text(str(p.active), style="green" if p.active else "dim"),
                            str(p.idle), str(p.parked),
                            Text(str(p.waiting), style="bold yellow" if p.waiting else "dim"),
                            Text(fmt.ms(p.max_wait_ms), style="yellow" if p.max_wait_ms else "dim"),
                            Text(str(p.pinned), style="yellow" if p.pinned else "dim"),
                            Text.assemble((fmt.bar(sat or 0, 6), fmt.saturation_style(sat)), f" {fmt.percent(sat)}"),
                            fmt.breaker_text(p.breaker),
                        ],
                    )
                )  # fmt: skip
            for c in state.clients.clients if state.clients else []:
                if not matches(
                    f,
                    state.name,
                    c.id,
                    c.addr,
                    c.database,
                    c.user,
                    c.application_name,
                    c.state,
                    c.query,
                ):
                    continue  # fmt: skip
                running = fmt.ms(c.running_ms) if c.running_ms is not None else (
                    f"wait {fmt.ms(c.wait_ms)}" if c.waiting else "–"
                )  # fmt: skip
                clients.append(
                    (
                        row_key(state.name, c.id),
                        [
                            state.name, Text(c.id, style="cyan"), c.addr, f"{c.database}/{c.user}",
                            fmt.shorten(c.application_name, 16),
                            Text(c.state + (" 📌" if c.pinned else ""), style=STATE_STYLES.get(c.state, "")),
                            c.server_id or "–", running, fmt.shorten(c.query or "", 40),
                        ],
                    )
                )  # fmt: skip
            for s in state.servers.servers if state.servers else []:
                if not matches(f, state.name, s.id, s.database, s.user, s.state, s.client_id):
                    continue
                servers.append(
                    (
                        row_key(state.name, s.id),
                        [
                            state.name, Text(s.id, style="cyan"), f"{s.database}/{s.user}",
                            Text(s.state + (" 📌" if s.pinned else ""), style=STATE_STYLES.get(s.state, "")),
                            s.client_id or "–", str(s.backend_pid), s.tx_status,
                            fmt.duration(s.age_s), fmt.duration(s.idle_s),
                        ],
                    )
                )  # fmt: skip
        sync_table(self.query_one("#pools-table", DataTable), pools)
        sync_table(self.query_one("#clients-table", DataTable), clients)
        sync_table(self.query_one("#servers-table", DataTable), servers)
        waiting = sum(p.waiting for s in self.states if s.up and s.pools for p in s.pools.pools)
        parts: list[str | Text | tuple[str, str]] = [
            ("Pools ", "bold"),
            f"{len(pools)} pools · {len(clients)} clients · {len(servers)} servers",
            ("  ·  ", "dim"),
            (f"{waiting} waiting", "bold yellow" if waiting else "dim"),
        ]
        self.set_caption_with_gaps(*parts)

    def selected_client(self) -> tuple[str, str] | None:
        """(proxy, client id) under the clients table's cursor."""
        key = selected_key(self.query_one("#clients-table", DataTable))
        if key is None:
            return None
        proxy, client_id = split_key(key)
        return proxy, client_id
