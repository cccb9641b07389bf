"""Pure formatting helpers for the console: numbers, durations, sparklines, bars.

Nothing here touches Textual; everything takes plain values and returns
strings or :class:`rich.text.Text`, so it is unit-tested without an app.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence

from rich.text import Text

SPARK_CHARS = "▁▂▃▄▅▆▇█"
BAR_FULL = "█"
BAR_PARTIAL = " ▏▎▍▌▋▊▉"


def ms(value: float | None) -> str:
    """Milliseconds, with as many decimals as are useful: 0.12, 1.23, 12.3, 123, 1.2s."""
    if value is None:
        return "–"
    if value >= 10_000:
        return f"{value / 1000:.1f}s"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def count(value: float | None) -> str:
    """An integer-ish count with a k/M suffix when large: 999, 12.3k, 4.5M."""
    if value is None:
        return "–"
    value = float(value)
    if abs(value) >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if abs(value) >= 10_000:
        return f"{value / 1000:.1f}k"
    return f"{value:,.0f}"


def rate(value: float | None) -> str:
    """A per-second rate: 0.5, 12.3, 1,234."""
    if value is None:
        return "–"
    if value < 10:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def percent(fraction: float | None) -> str:
    if fraction is None:
        return "–"
    return f"{fraction * 100:.1f}%"


def duration(seconds: float | None) -> str:
    """A short human duration: 45s, 3m12s, 2h05m, 3d4h."""
    if seconds is None:
        return "–"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def clock(ts: float | None, tz: dt.tzinfo | None = None, millis: bool = False) -> str:
    """Wall-clock time of an epoch timestamp: 14:03:07 (or 14:03:07.123)."""
    if ts is None:
        return "–"
    moment = dt.datetime.fromtimestamp(ts, tz=tz)
    text = moment.strftime("%H:%M:%S")
    if millis:
        text += f".{moment.microsecond // 1000:03d}"
    return text


def stamp(ts: float, tz: dt.tzinfo | None = None) -> str:
    """A full timestamp for titles and file names' companions: 2024-05-01 14:03:07 UTC."""
    moment = dt.datetime.fromtimestamp(ts, tz=tz)
    if moment.tzinfo is None:
        moment = moment.astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def sparkline(values: Iterable[float | None], width: int = 16) -> str:
    """A unicode sparkline of the last ``width`` values (scaled to their own max)."""
    points = [v for v in values if v is not None][-width:]
    if not points:
        return ""
    top = max(points)
    low = min(points)
    if top <= 0:
        return SPARK_CHARS[0] * len(points)
    span = top - low if top > low else top
    base = low if top > low else 0.0
    last = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[min(last, int((v - base) / span * last + 0.5))] for v in points)


def bar(fraction: float, width: int = 10) -> str:
    """A horizontal bar of ``width`` cells filled to ``fraction`` (eighths of a cell)."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    text = BAR_FULL * full + (BAR_PARTIAL[part] if part else "")
    return text.ljust(width)


def saturation_style(fraction: float | None) -> str:
    """Green under 70%, yellow under 90%, red above."""
    if fraction is None:
        return "dim"
    if fraction >= 0.9:
        return "bold red"
    if fraction >= 0.7:
        return "yellow"
    return "green"


def breaker_text(state: str | None) -> Text:
    """A breaker state, colored: closed green, half_open yellow, open red."""
    if not state:
        return Text("–", style="dim")
    style = {"closed": "green", "half_open": "bold yellow", "open": "bold red"}.get(state, "")
    icon = {"closed": "●", "half_open": "◐", "open": "○"}.get(state, "?")
    return Text(f"{icon} {state.replace('_', '-')}", style=style)


def severity_style(severity: str) -> str:
    return {"critical": "bold red", "warning": "yellow", "info": "cyan"}.get(severity, "yellow")


def delta_arrow(old: float | None, new: float | None, tolerance: float = 0.1) -> Text:
    """↑ or ↓ when ``new`` moved more than ``tolerance`` (relative) from ``old``.

    Up is red (slower / more), down green; unchanged is a dim dot; no previous
    value is blank.
    """
    if old is None or new is None:
        return Text(" ")
    if old == 0:
        return Text("↑", style="red") if new > 0 else Text("·", style="dim")
    change = (new - old) / abs(old)
    if change > tolerance:
        return Text("↑", style="red")
    if change < -tolerance:
        return Text("↓", style="green")
    return Text("·", style="dim")


def rank_change(old_rank: int | None, new_rank: int) -> Text:
    """k9s-style rank movement: ↑2 (climbed), ↓1, new, or a dim dot."""
    if old_rank is None:
        return Text("new", style="cyan")
    if new_rank < old_rank:
        return Text(f"↑{old_rank - new_rank}", style="bold red")
    if new_rank > old_rank:
        return Text(f"↓{new_rank - old_rank}", style="green")
    return Text("·", style="dim")


def shorten(text: str, width: int) -> str:
    """One line, at most ``width`` characters (an ellipsis marks the cut)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: max(0, width - 1)] + "…"


def histogram(values_ms: Sequence[float], bins: int = 12) -> list[tuple[str, int]]:
    """Log-scale latency buckets of ``values_ms``: [(label, count), ...].

    Bucket edges double from the smallest power of two below the minimum, so
    a histogram of 0.3 ms and 300 ms values stays readable.
    """
    if not values_ms:
        return []
    low = max(min(values_ms), 0.001)
    edge = 2.0 ** int(_floor_log2(low))
    edges = [edge * 2**i for i in range(bins + 1)]
    counts = [0] * bins
    for v in values_ms:
        for i in range(bins):
            if v < edges[i + 1] or i == bins - 1:
                counts[i] += 1
                break
    # Trim empty buckets at the top.
    while len(counts) > 1 and counts[-1] == 0:
        counts.pop()
    return [(f"<{ms(edges[i + 1])}", counts[i]) for i in range(len(counts))]


def _floor_log2(value: float) -> int:
    n = 0
    if value >= 1:
        while value >= 2:
            value /= 2
            n += 1
        return n
    while value < 1:
        value *= 2
        n -= 1
    return n
