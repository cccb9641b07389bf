"""What every view shares: row-key table updates, filtering, the view base class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import DataTable, Static
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

if TYPE_CHECKING:
    from scry_tui.app import ScryConsole
    from scry_tui.model import ProxyState

Row = tuple[str, Sequence[Any]]  # (row key, cells)


def plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def matches(filter_text: str, *fields: Any) -> bool:
    """Case-insensitive substring match of ``filter_text`` against any field."""
    if not filter_text:
        return True
    needle = filter_text.lower()
    return any(needle in plain(f).lower() for f in fields if f is not None)


def sync_table(table: DataTable[Any], rows: Sequence[Row]) -> None:
    """Make ``table`` show ``rows`` in this order, touching only what changed.

    Rows are matched by key: changed cells are updated in place, vanished rows
    removed, new rows added, then the order fixed. The cursor stays on the
    row it was on (by key), not on the same line, so it never jumps.
    """
    columns = list(table.columns)
    cursor_key = None
    if table.row_count and table.cursor_row >= 0:
        try:
            cursor_key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except (CellDoesNotExist, RowDoesNotExist):
            cursor_key = None
    wanted = {key for key, _ in rows}
    for row_key in list(table.rows):
        if row_key.value not in wanted:
            table.remove_row(row_key)
    existing = {rk.value for rk in table.rows}
    for key, cells in rows:
        if key in existing:
            for column, value in zip(columns, cells, strict=False):
                if plain(table.get_cell(key, column)) != plain(value) or (
                    isinstance(value, Text) and table.get_cell(key, column) != value
                ):
                    table.update_cell(key, column, value, update_width=True)
        else:
            table.add_row(*cells, key=key)
    order = {key: i for i, (key, _) in enumerate(rows)}
    current = [row.key.value for row in table.ordered_rows]
    if current != [key for key, _ in rows]:
        index = {tuple(plain(c) for c in cells): order[key] for key, cells in rows}
        table.sort(key=lambda values: index.get(tuple(plain(v) for v in values), len(order)))
    if cursor_key is not None and cursor_key in wanted:
        row_index = table.get_row_index(cursor_key)
        if row_index != table.cursor_row:
            table.move_cursor(row=row_index, animate=False, scroll=False)


def selected_key(table: DataTable[Any]) -> str | None:
    """The row key under the cursor, or None for an empty table."""
    if not table.row_count:
        return None
    try:
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except (CellDoesNotExist, RowDoesNotExist):
        return None
    return str(key) if key is not None else None


def row_key(*parts: str) -> str:
    return "\x1f".join(parts)


def split_key(key: str) -> list[str]:
    return key.split("\x1f")


class View(Vertical):
    """A console view: a caption line and its widgets; redrawn from the app's states."""

    view_id = ""
    title = ""
    filter_text = ""

    def caption(self) -> Static:
        return Static("", classes="caption", id=f"{self.view_id}-caption", markup=False)

    @property
    def console(self) -> ScryConsole:
        return self.app  # type: ignore[return-value]

    @property
    def states(self) -> list[ProxyState]:
        return self.console.ordered_states()

    def set_caption(self, *parts: str | Text | tuple[str, str]) -> None:
        text = Text.assemble(*parts)
        if self.filter_text:
            text.append("  filter ", style="dim")
            text.append(f"/{self.filter_text}", style="bold magenta")
        self.query_one(f"#{self.view_id}-caption", Static).update(text)

    def set_caption_with_gaps(self, *parts: str | Text | tuple[str, str]) -> None:
        """The caption, followed by a warning when some proxy's data is missing."""
        note = self.down_note()
        self.set_caption(*parts, *(() if note is None else (note,)))

    def refresh_view(self) -> None:  # pragma: no cover - every view overrides it
        raise NotImplementedError

    def on_show(self) -> None:
        self.refresh_view()

    def multi(self) -> bool:
        return len(self.states) > 1

    def down_note(self) -> Text | None:
        """A warning naming proxies whose data is missing from this view."""
        down = [s for s in self.states if not s.up]
        failed = [
            f"{topic} {error} on {s.name}"
            for s in self.states
            if s.up
            for topic, error in s.topic_errors.items()
        ]
        if not down and not failed:
            return None
        text = Text()
        if down:
            text.append(f"  ✖ no data from {', '.join(s.name for s in down)}", style="red")
        if failed:
            text.append(f"  ✖ {'; '.join(failed)}", style="red")
        return text


class ConsoleTable(DataTable[Any]):
    """A DataTable whose columns may widen when a cell is updated in place.

    Textual re-measures columns on idle after ``update_cell(update_width=True)``
    but keeps rows rendered with the old widths in its caches, which cuts the
    new values (``1,121`` shown as ``1,1``). Clearing the caches once the widths
    changed fixes that without rebuilding the table (and moving the cursor).
    """

    def _update_column_widths(self, updated_cells: Any) -> None:
        before = [c.content_width for c in self.columns.values()]
        super()._update_column_widths(updated_cells)
        if [c.content_width for c in self.columns.values()] != before:
            self._clear_caches()
            self.refresh()
