"""The console's views, one module each."""

from scry_tui.views.breaker import BreakerView
from scry_tui.views.fleet import FleetView
from scry_tui.views.hot import HotView
from scry_tui.views.pins import PinsView
from scry_tui.views.pools import PoolsView
from scry_tui.views.tail import TailView
from scry_tui.views.top import TopView

VIEW_CLASSES = (FleetView, TopView, TailView, PoolsView, PinsView, BreakerView, HotView)

__all__ = [
    "VIEW_CLASSES",
    "BreakerView",
    "FleetView",
    "HotView",
    "PinsView",
    "PoolsView",
    "TailView",
    "TopView",
]
