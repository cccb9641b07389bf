"""The console's one action registry.

Every key the console answers is an :class:`ActionSpec` here. The registry
feeds the app's bindings (each with a stable ``id``, so a keymap can rebind
it), the footer, the help screen (``?``) and the command palette; nothing
else declares keys. Destructive actions are marked, so ``--read-only`` hides
them everywhere at once and refuses them if they are invoked anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding

#: The console's views, in number-key order: (id, title, aliases for `:`).
VIEWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("fleet", "Fleet", ("f", "proxies", "overview")),
    ("top", "Top", ("t", "queries", "fingerprints", "q")),
    ("tail", "Tail", ("events", "log", "stream")),
    ("pools", "Pools", ("p", "po", "clients", "servers")),
    ("pins", "Pins", ("pin", "pinned")),
    ("breaker", "Breaker", ("b", "health", "cb")),
    ("hot", "Hot", ("h", "hotdata", "hot_data")),
)
VIEW_IDS = tuple(v[0] for v in VIEWS)


def view_for(word: str) -> str | None:
    """The view a `:` command names (id, title or alias, any case), or None."""
    word = word.strip().lower().lstrip(":")
    for view_id, title, aliases in VIEWS:
        if word in (view_id, title.lower(), *aliases):
            return view_id
    return None


@dataclass(frozen=True)
class ActionSpec:
    """One thing the operator can do."""

    id: str  # stable binding id (keymaps refer to it)
    keys: str  # Textual key names, comma separated
    action: str  # Textual action string, e.g. "show_view('top')"
    description: str  # short: the footer
    help: str  # one sentence: the help screen and the palette
    group: str = "General"
    views: tuple[str, ...] = ()  # () = everywhere
    destructive: bool = False
    show: bool = True  # in the footer
    key_display: str | None = None
    priority: bool = False

    @property
    def action_name(self) -> str:
        return self.action.split("(", 1)[0]

    def binding(self) -> Binding:
        return Binding(
            self.keys,
            self.action,
            self.description,
            show=self.show,
            key_display=self.key_display,
            priority=self.priority,
            id=self.id,
            tooltip=self.help,
        )

    def applies_to(self, view: str) -> bool:
        return not self.views or view in self.views


def _view_actions() -> list[ActionSpec]:
    return [
        ActionSpec(
            id=f"view.{view_id}",
            keys=str(n),
            action=f"show_view('{view_id}')",
            description=title,
            help=f"Show the {title} view.",
            group="Views",
            show=False,
        )
        for n, (view_id, title, _aliases) in enumerate(VIEWS, start=1)
    ]


ACTIONS: tuple[ActionSpec, ...] = (
    *_view_actions(),
    ActionSpec(
        "app.jump",
        "colon",
        "jump",
        "Jump",
        "Jump to a view by name (k9s-style `:top`).",
        "Views",
        key_display=":",
    ),  # fmt: skip
    ActionSpec(
        "app.filter",
        "slash",
        "filter",
        "Filter",
        "Filter the rows of this view (substring, any column).",
        key_display="/",
    ),  # fmt: skip
    ActionSpec(
        "app.pause", "p", "toggle_pause", "Pause", "Pause or resume refreshing (and the tail)."
    ),
    ActionSpec("app.refresh", "r", "refresh_now", "Refresh", "Poll every proxy now.", show=False),
    ActionSpec(
        "app.faster",
        "plus,equals_sign",
        "refresh_rate(-1)",
        "Faster",
        "Refresh more often.",
        show=False,
        key_display="+",
    ),  # fmt: skip
    ActionSpec(
        "app.slower",
        "minus",
        "refresh_rate(1)",
        "Slower",
        "Refresh less often.",
        show=False,
        key_display="-",
    ),  # fmt: skip
    ActionSpec(
        "app.screenshot",
        "ctrl+s",
        "screenshot",
        "Screenshot",
        "Save the current view as an SVG file.",
        show=False,
    ),  # fmt: skip
    ActionSpec(
        "app.help",
        "question_mark",
        "help",
        "Help",
        "Show every key and what it does.",
        key_display="?",
    ),  # fmt: skip
    ActionSpec("app.quit", "q", "quit", "Quit", "Leave the console (closes SSH tunnels)."),
    ActionSpec(
        "top.sort",
        "s",
        "cycle_sort",
        "Sort",
        "Rank by total time, mean, calls, errors or p99.",
        "Top",
        ("top",),
    ),  # fmt: skip
    ActionSpec(
        "top.scope",
        "m",
        "toggle_scope",
        "Fleet/proxy",
        "Rank across the whole fleet (merged by fingerprint) or one proxy.",
        "Top",
        ("top",),
    ),  # fmt: skip
    ActionSpec(
        "top.next_proxy",
        "n",
        "next_proxy",
        "Next proxy",
        "In one-proxy scope, show the next proxy.",
        "Top",
        ("top",),
        show=False,
    ),  # fmt: skip
    ActionSpec(
        "top.detail",
        "enter",
        "open_detail",
        "Detail",
        "Open the fingerprint: text, timeline, histogram, live tail.",
        "Top",
        ("top",),
        show=False,
    ),  # fmt: skip
    ActionSpec(
        "tail.follow",
        "f",
        "toggle_follow",
        "Follow",
        "Follow the end of the tail, or stop following to read.",
        "Tail",
        ("tail",),
    ),  # fmt: skip
    ActionSpec(
        "tail.errors",
        "e",
        "toggle_errors",
        "Errors only",
        "Show only failed statements.",
        "Tail",
        ("tail",),
    ),  # fmt: skip
    ActionSpec(
        "tail.clear", "c", "clear_tail", "Clear", "Clear the tail.", "Tail", ("tail",), show=False
    ),  # fmt: skip
    ActionSpec(
        "pins.unpin",
        "u",
        "unpin",
        "Force-unpin",
        "Force-unpin the selected session.",
        "Actions",
        ("pins",),
        destructive=True,
    ),  # fmt: skip
    ActionSpec(
        "pools.kill",
        "K",
        "kill_client",
        "Kill client",
        "Disconnect the selected client.",
        "Actions",
        ("pools",),
        destructive=True,
    ),  # fmt: skip
    ActionSpec(
        "breaker.trip",
        "T",
        "trip",
        "Trip",
        "Open the selected database's breaker.",
        "Actions",
        ("breaker",),
        destructive=True,
    ),  # fmt: skip
    ActionSpec(
        "breaker.reset",
        "R",
        "reset",
        "Reset",
        "Close the selected database's breaker.",
        "Actions",
        ("breaker",),
        destructive=True,
    ),  # fmt: skip
)

ACTION_BY_NAME: dict[str, ActionSpec] = {a.action_name: a for a in ACTIONS}
DESTRUCTIVE_KEYS: dict[str, ActionSpec] = {
    key: a for a in ACTIONS if a.destructive for key in a.keys.split(",")
}


def bindings() -> list[Binding]:
    """The app's bindings, generated from the registry."""
    return [a.binding() for a in ACTIONS]


def display_keys(spec: ActionSpec) -> str:
    if spec.key_display:
        return spec.key_display
    names = {"enter": "⏎", "ctrl+s": "^s", "minus": "-", "plus": "+"}
    return "/".join(names.get(k, k) for k in spec.keys.split(","))
