"""One console answer out of every worker's, for ``workers: N``.

Each worker answers a console command for itself (scry.pgbouncer.dispatch);
the worker a console session is connected to gathers their answers over the
peering sockets (scry.pgbouncer.instance) and merges them here. Pure: wire
bytes in (RowDescription, DataRows, CommandComplete, ReadyForQuery), wire
bytes out.

How a SHOW's rows merge:

* **one row per key** (SHOW POOLS per database and user, SHOW STATS per
  database...): counts add up, and so do budgets, since each worker holds
  its share of ``pool_size``, ``max_client_conn``...; the longest wait is
  the longest of any worker's; flags are set when set anywhere; per-query
  times are means weighted by each worker's query rate; settings and text
  are the same everywhere (the first worker's);
* **one row per connection** (SHOW CLIENTS, SERVERS, SOCKETS...): every
  worker's rows, with ids made unique over the instance (``id`` n of worker
  w is ``n * workers + w``, ``ptr`` c12 is ``w1.c12``, as the admin API
  names them);
* **the same everywhere** (SHOW VERSION, CONFIG, STATE...): the answer of
  the worker the session is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal

from scry.adminapi.fleet import qualify
from scry.pgbouncer.results import ADMIN_DB, TEXT, result
from scry.protocol import messages as m
from scry.protocol.framing import MessageReader

__all__ = ["Answer", "instance_id", "local_id", "merge_show", "parse_answer"]

Value = str | None
Columns = list[tuple[str, int]]
Rows = list[list[Value]]

# Console answers are built in-process and read whole: no packet limit applies.
_NO_LIMIT = 1 << 40


@dataclass
class Answer:
    """A console answer taken apart: its result set (if any), tag and error."""

    columns: Columns | None = None
    rows: Rows = field(default_factory=list)
    tag: str = ""
    error: dict[str, str] | None = None


def parse_answer(data: bytes) -> Answer:
    reader = MessageReader(_NO_LIMIT)
    reader.feed(data)
    answer = Answer()
    for kind, body in reader.messages():
        if kind == ord("T"):
            answer.columns = m.parse_row_description(body)
        elif kind == ord("D"):
            row = m.parse_data_row(body)
            answer.rows.append([None if v is None else v.decode() for v in row])
        elif kind == ord("C"):
            answer.tag = body.rstrip(b"\x00").decode()
        elif kind == ord("E"):
            answer.error = m.parse_fields(body)
    return answer


def instance_id(local: int, worker: int, workers: int) -> int:
    """A worker's connection id as the instance's console numbers it."""
    return local * workers + worker


def local_id(number: int, workers: int) -> tuple[int, int]:
    """(worker, the worker's own id) of an instance-wide connection id."""
    return number % workers, number // workers


# --------------------------------------------------------------------------- #
# Numbers
# --------------------------------------------------------------------------- #

Number = int | Decimal


def _number(value: Value) -> Number | None:
    if value is None or value == "":
        return None
    return Decimal(value) if "." in value else int(value)


def _text(value: Number | None) -> Value:
    return None if value is None else str(value)


def _first(values: Sequence[Value]) -> Value:
    return next((v for v in values if v is not None), None)


# --------------------------------------------------------------------------- #
# Rows merged by key
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Keyed:
    """How the rows of one view merge when their ``keys`` columns are equal.

    Numeric columns add up unless named otherwise; text columns are the
    first worker's.
    """

    keys: tuple[str, ...]
    #: Settings: the same on every worker (the first one's value).
    same: frozenset[str] = frozenset()
    #: Each worker's share of a budget (added up), but on the console's own
    #: row (the ``pgbouncer`` database), a setting like ``same``.
    budgets: frozenset[str] = frozenset()
    #: The largest value (flags; SHOW BREAKER's failures are per worker).
    most: frozenset[str] = frozenset()
    #: Means weighted by another column's per-worker values (times per query).
    weighted: Mapping[str, str] = field(default_factory=dict)
    #: A wait given as (seconds, microseconds): the longest one.
    wait: tuple[str, str] | None = None
    #: Text columns whose values rank, least to most severe: the most severe.
    ranked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __call__(self, columns: Columns, answers: Mapping[int, Answer], workers: int) -> Rows:
        index = {name: i for i, (name, _type) in enumerate(columns)}
        key_at = [index[k] for k in self.keys]
        groups: dict[tuple[Value, ...], Rows] = {}
        for answer in answers.values():
            for row in answer.rows:
                groups.setdefault(tuple(row[i] for i in key_at), []).append(row)
        return [self._merge(columns, index, rows) for rows in groups.values()]

    def _merge(self, columns: Columns, index: dict[str, int], rows: Rows) -> list[Value]:
        if len(rows) == 1:
            return rows[0]
        console_row = rows[0][index[self.keys[0]]] == ADMIN_DB
        out = list(rows[0])
        for i, (name, type_oid) in enumerate(columns):
            values = [row[i] for row in rows]
            if name in self.ranked:
                order = self.ranked[name]
                out[i] = max(values, key=lambda v: order.index(v) if v in order else -1)
            elif (
                name in self.keys
                or type_oid == TEXT
                or name in self.same
                or (console_row and name in self.budgets)
            ):
                out[i] = _first(values)
            elif name in self.weighted:
                weights = [_number(row[index[self.weighted[name]]]) or 0 for row in rows]
                total = sum(weights)
                weighted = sum((_number(v) or 0) * w for v, w in zip(values, weights, strict=True))
                out[i] = _text(int(weighted / total) if total else 0)
            else:
                numbers = [n for n in map(_number, values) if n is not None]
                if numbers:
                    out[i] = _text(max(numbers) if name in self.most else sum(numbers))
        if self.wait is not None:
            seconds, micros = index[self.wait[0]], index[self.wait[1]]
            longest = max(rows, key=lambda r: (_number(r[seconds]) or 0, _number(r[micros]) or 0))
            out[seconds], out[micros] = longest[seconds], longest[micros]
        return out


# --------------------------------------------------------------------------- #
# The views
# --------------------------------------------------------------------------- #

#: Id columns of the connection views, and how each is made instance-wide.
_NUMBER_IDS = ("id", "client_id", "server_id")
_POINTER_IDS = ("ptr", "link")


def _connections(columns: Columns, answers: Mapping[int, Answer], workers: int) -> Rows:
    """Every worker's connections, with instance-wide ids (sorted by id)."""
    names = [name for name, _type in columns]
    numbers = [i for i, name in enumerate(names) if name in _NUMBER_IDS]
    pointers = [i for i, name in enumerate(names) if name in _POINTER_IDS]
    rows: Rows = []
    for worker, answer in answers.items():
        for row in answer.rows:
            row = list(row)
            for i in numbers:
                if row[i] is not None:
                    row[i] = str(instance_id(int(row[i]), worker, workers))
            for i in pointers:
                if row[i]:
                    row[i] = qualify(worker, row[i])
            rows.append(row)
    if numbers:
        first = numbers[0]
        rows.sort(key=lambda row: int(row[first] or 0))
    return rows


# SHOW LISTS: these count things each worker has; the rest (databases,
# users, pools...) are the same configured names on every worker.
_LIST_COUNTS = frozenset({"free_clients", "used_clients", "login_clients", "free_servers",
                          "used_servers", "dns_queries", "dns_pending"})  # fmt: skip


def _lists(columns: Columns, answers: Mapping[int, Answer], workers: int) -> Rows:
    merged: dict[Value, list[int]] = {}
    for answer in answers.values():
        for name, items in answer.rows:
            merged.setdefault(name, []).append(int(items or 0))
    return [[name, str(sum(v) if name in _LIST_COUNTS else max(v))] for name, v in merged.items()]


#: SHOW STATS' and TOTALS' times per transaction or query, and the rate
#: that weighs each worker's (as SHOW TOTALS weighs them over databases).
_RATE_OF = {"avg_xact_time": "avg_xact_count", "avg_query_time": "avg_query_count",
            "avg_wait_time": "avg_query_count"}  # fmt: skip


def _totals(columns: Columns, answers: Mapping[int, Answer], workers: int) -> Rows:
    """SHOW TOTALS: name/value rows, added up but for the weighted times."""
    per_worker = [{name: _number(value) or 0 for name, value in a.rows} for a in answers.values()]
    names = [name for name, _value in next(iter(answers.values())).rows]
    rows: Rows = []
    for name in names:
        values = [w.get(name, 0) for w in per_worker]
        weight_name = _RATE_OF.get(name or "")
        if weight_name is None:
            rows.append([name, _text(sum(values))])
            continue
        weights = [w.get(weight_name, 0) for w in per_worker]
        total = sum(weights)
        mean = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0
        rows.append([name, _text(int(mean))])
    return rows


_Merger = Callable[[Columns, Mapping[int, Answer], int], Rows]

_AVERAGES_WEIGHTS = {"xact_time": "xact_count", "query_time": "query_count",
                     "wait_time": "query_count"}  # fmt: skip

#: The views whose rows merge; every other SHOW is the same on every worker.
MERGERS: dict[str, _Merger] = {
    "pools": Keyed(("database", "user"), wait=("maxwait", "maxwait_us")),
    "databases": Keyed(
        ("name",),
        same=frozenset({"port", "server_lifetime"}),
        budgets=frozenset(
            {
                "pool_size",
                "min_pool_size",
                "reserve_pool_size",
                "max_connections",
                "max_client_connections",
            }
        ),  # fmt: skip
        most=frozenset({"paused", "disabled"}),
    ),
    "users": Keyed(("name",)),
    "lists": _lists,
    "stats": Keyed(("database",), weighted=_RATE_OF),
    "stats_totals": Keyed(("database",)),
    "stats_averages": Keyed(("database",), weighted=_AVERAGES_WEIGHTS),
    "totals": _totals,
    "clients": _connections,
    "servers": _connections,
    "sockets": _connections,
    "active_sockets": _connections,
    "pins": _connections,
    "dns_hosts": Keyed(("hostname",), same=frozenset({"ttl"})),
    "breaker": Keyed(
        ("database",),
        most=frozenset({"failures"}),
        ranked={"state": ("closed", "half_open", "open")},
    ),  # fmt: skip
}


def merge_show(view: str, answers: Mapping[int, bytes], own: int, workers: int) -> bytes:
    """The instance's answer to SHOW ``view`` from every worker's ``answers``
    (``own``: the worker the console session is on, whose answer stands for
    views that are the same everywhere, and for errors). A worker whose
    result set has other columns (a rolling upgrade) is left out."""
    merger = MERGERS.get(view)
    if merger is None:
        return answers[own]
    parsed = {worker: parse_answer(answers[worker]) for worker in sorted(answers)}
    mine = parsed[own]
    if mine.columns is None or mine.error is not None:
        return answers[own]
    same = {w: a for w, a in parsed.items() if a.columns == mine.columns and a.error is None}
    return result(mine.columns, merger(mine.columns, same, workers), mine.tag)
