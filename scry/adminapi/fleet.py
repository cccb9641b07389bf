"""Merging the workers' answers into one instance's (pure: data in, data out).

Worker 0 asks every worker of its instance (scry.adminapi.instance) and
merges what they answer here. Inputs are ``{worker id: payload}`` with the
JSON shapes of ``admin.schemas`` (or the exports of scry.adminapi.local);
outputs are payload dicts ready for ``model_validate``.

Rules (docs/admin-api.md, "Workers"):

* counters and sizes add up; "oldest" and "longest" figures take the
  maximum; a breaker's state is the most open one;
* rows of listings keep their worker's id in ``worker`` and their ids are
  qualified by it (``w1.c12``): ids are per process, and an action on a
  qualified id goes to the worker that owns it;
* latency percentiles come from merged histograms (scry.observe.stats),
  hot data from merged sketches (scry.observe.sketch), never from averaging
  percentiles;
* Prometheus families add up sample by sample, as prometheus-client's
  multiprocess mode does; gauges say how (``GAUGE_MERGE``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

__all__ = [
    "GAUGE_MERGE",
    "merge_breakers",
    "merge_listing",
    "merge_metrics",
    "merge_pins",
    "merge_pools",
    "merge_status",
    "page_plan",
    "parse_id",
    "qualify",
    "qualify_event",
    "render_metrics",
]

_QUALIFIED = re.compile(r"w(\d{1,2})\.(.+)")
_SEVERITY = {"closed": 0, "half_open": 1, "open": 2}
#: Transitions kept in a merged breaker snapshot (most recent first).
MAX_TRANSITIONS = 50


# --------------------------------------------------------------------------- #
# Ids
# --------------------------------------------------------------------------- #


def qualify(worker: int, ident: str | None) -> str | None:
    """A connection id made unique in the instance: ``c12`` of worker 1 is ``w1.c12``."""
    return None if ident is None else f"w{worker}.{ident}"


def parse_id(text: str) -> tuple[int | None, str]:
    """``w1.c12`` -> (1, "c12"); an unqualified id -> (None, id)."""
    match = _QUALIFIED.fullmatch(text)
    if match is None:
        return None, text
    return int(match[1]), match[2]


def _tag(worker: int, row: dict[str, Any], id_fields: Iterable[str]) -> dict[str, Any]:
    row = dict(row)
    for name in id_fields:
        row[name] = qualify(worker, row.get(name))
    row["worker"] = worker
    return row


def qualify_event(worker: int, event: dict[str, Any]) -> dict[str, Any]:
    """A tail event of one worker, as the instance's tail shows it."""
    return {**event, "client_id": qualify(worker, event.get("client_id")), "worker": worker}


# --------------------------------------------------------------------------- #
# Status and pools
# --------------------------------------------------------------------------- #

_STATUS_SUMS = ("clients", "servers", "waiting", "pinned")
_SUMMARY_SUMS = (
    "events_dropped",
    "events_lost",
    "tail_events_dropped",
    "records_dropped",
    "records_pending",
    "shapes_parsed",
)


def merge_status(
    answers: dict[int, dict[str, Any]], queries: dict[str, Any], instance_pid: int
) -> dict[str, Any]:
    """The instance's Status from the workers' ``status`` answers.

    ``queries`` is the merged statistics summary (stats.merge_summaries of the
    workers' exports). ``pid`` is the instance's (the supervisor: signals
    sent to it reach every worker); ``per_worker`` keeps each worker's own.
    """
    statuses = [answers[k]["status"] for k in sorted(answers)]
    first = statuses[0]
    merged = dict(first)
    merged.update(
        pid=instance_pid,
        worker=first["worker"],
        started_at=min(x["started_at"] for x in statuses),
        uptime_s=max(x["uptime_s"] for x in statuses),
        listen_addresses=sorted({a for x in statuses for a in x["listen_addresses"]}),
        admin_addr=next((x["admin_addr"] for x in statuses if x["admin_addr"]), ""),
        databases=sorted({d for x in statuses for d in x["databases"]}),
        draining=any(x["draining"] for x in statuses),
        paused=any(x["paused"] for x in statuses),
        pools=len({tuple(key) for k in answers for key in answers[k]["pools"]}),
        per_worker=statuses,
    )
    for name in _STATUS_SUMS:
        merged[name] = sum(x[name] for x in statuses)
    totals = dict(first["queries"])
    totals.update(queries)
    for name in _SUMMARY_SUMS:
        totals[name] = sum(x["queries"][name] for x in statuses)
    totals["anonymize"] = all(x["queries"]["anonymize"] for x in statuses)
    totals["anonymize_key_random"] = any(x["queries"]["anonymize_key_random"] for x in statuses)
    merged["queries"] = totals
    return merged


_POOL_SUMS = (
    "size",
    "min_size",
    "reserve_size",
    "reserve_in_use",
    "servers",
    "connecting",
    "active",
    "idle",
    "parked",
    "waiting",
    "pinned",
)
_POOL_TOTAL_SUMS = ("waits", "wait_ms_total", "servers_opened", "servers_closed")


def merge_pools(answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One pool per (database, user): sizes and counts added up, the longest
    wait, the most open breaker; ``workers`` lists the workers that have it."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for worker in sorted(answers):
        for pool in answers[worker]["pools"]:
            key = (pool["database"], pool["user"])
            m = merged.get(key)
            if m is None:
                merged[key] = {**pool, "totals": dict(pool["totals"]), "workers": [worker]}
                continue
            for name in _POOL_SUMS:
                m[name] += pool[name]
            totals = m["totals"]
            for name in _POOL_TOTAL_SUMS:
                totals[name] += pool["totals"][name]
            m["max_wait_ms"] = max(m["max_wait_ms"], pool["max_wait_ms"])
            m["stale"] = m["stale"] or pool["stale"]
            m["breaker"] = _most_open(m["breaker"], pool["breaker"])
            m["last_error"] = m["last_error"] or pool["last_error"]
            m["workers"].append(worker)
    for m in merged.values():
        totals = m["totals"]
        totals["wait_ms_mean"] = (
            totals["wait_ms_total"] / totals["waits"] if totals["waits"] else 0.0
        )
    return {"pools": list(merged.values())}


def _most_open(a: str, b: str) -> str:
    return a if _SEVERITY.get(a, 2) >= _SEVERITY.get(b, 2) else b


# --------------------------------------------------------------------------- #
# Listings
# --------------------------------------------------------------------------- #

#: The id fields of each listing's rows (qualified with the worker).
LISTING_IDS = {
    "clients": ("id", "server_id"),
    "servers": ("id", "client_id"),
    "pins": ("client_id", "server_id"),
}


def page_plan(totals: dict[int, int], limit: int, offset: int) -> dict[int, tuple[int, int]]:
    """Which slice (limit, offset) of each worker's listing makes up the
    instance's page: rows are ordered by worker, then as each worker orders them."""
    plan = {}
    start = 0
    for worker in sorted(totals):
        total = totals[worker]
        low = max(offset, start)
        high = min(offset + limit, start + total)
        if high > low:
            plan[worker] = (high - low, low - start)
        start += total
    return plan


def merge_listing(
    kind: str, pages: dict[int, dict[str, Any]], total: int, limit: int, offset: int
) -> dict[str, Any]:
    """A clients or servers page from the workers' pages (see ``page_plan``)."""
    rows = [
        _tag(worker, row, LISTING_IDS[kind])
        for worker in sorted(pages)
        for row in pages[worker][kind]
    ]
    return {"total": total, "offset": offset, "limit": limit, kind: rows}


def merge_pins(answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {
        "pins": [
            _tag(worker, pin, LISTING_IDS["pins"])
            for worker in sorted(answers)
            for pin in answers[worker]["pins"]
        ]
    }


# --------------------------------------------------------------------------- #
# Breakers and health
# --------------------------------------------------------------------------- #


def merge_breakers(answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per database: a merged breaker and health view, and each worker's own."""
    by_database: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for worker in sorted(answers):
        for entry in answers[worker]["databases"]:
            by_database.setdefault(entry["database"], []).append((worker, entry))
    return {
        "databases": [
            {
                "database": database,
                "breaker": merge_breaker([(w, e["breaker"]) for w, e in entries]),
                "health": merge_health([(w, e["health"]) for w, e in entries]),
                "workers": [
                    {"worker": w, "breaker": e["breaker"], "health": e["health"]}
                    for w, e in entries
                ],
            }
            for database, entries in sorted(by_database.items())
        ]
    }


def merge_breaker(snapshots: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The most open worker's state (its reason and retry time), counters added
    up (``consecutive_failures``: the largest), every worker's transitions."""
    worst_worker, worst = max(snapshots, key=lambda ws: (_SEVERITY.get(ws[1]["state"], 2), -ws[0]))
    merged = dict(worst)
    counters = {name: 0 for name in worst["counters"]}
    for _, snap in snapshots:
        for name, value in snap["counters"].items():
            if name == "consecutive_failures":
                counters[name] = max(counters[name], value)
            else:
                counters[name] = counters.get(name, 0) + value
    merged["counters"] = counters
    merged["enabled"] = any(snap["enabled"] for _, snap in snapshots)
    merged["last_failure_reason"] = next(
        (snap["last_failure_reason"] for _, snap in snapshots if snap["last_failure_reason"]),
        None,
    )
    merged["half_open"] = {
        name: sum(snap["half_open"][name] for _, snap in snapshots) for name in worst["half_open"]
    }
    transitions = [{**t, "worker": w} for w, snap in snapshots for t in snap["transitions"]]
    transitions.sort(key=lambda t: t["at"], reverse=True)
    merged["transitions"] = transitions[:MAX_TRANSITIONS]
    reason = merged.get("open_reason")
    if reason and not reason.startswith("worker "):  # opened by another worker's says so
        merged["open_reason"] = f"worker {worst_worker}: {reason}"
    return merged


def _sum(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _max(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def merge_health(snapshots: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Counts added up (error rate recomputed from them); latency, wait and
    saturation figures are the worst worker's (a monitor keeps no histogram
    to merge); every worker's signals, each with its worker."""
    first = snapshots[0][1]
    windows = [snap["window"] for _, snap in snapshots]
    queries = _sum(w.get("queries") for w in windows)
    errors = _sum(w.get("errors") for w in windows)
    window = {
        "queries": queries,
        "errors": errors,
        "qps": _sum(w.get("qps") for w in windows),
        "error_rate": errors / queries if queries and errors is not None else None,
    }
    for name in ("p50", "p99", "wait_mean", "wait_max"):
        window[name] = _max(w.get(name) for w in windows)
    pools = [snap["pool"] for _, snap in snapshots]
    baselines = [snap["baseline"] for _, snap in snapshots]
    return {
        "name": first["name"],
        "window_seconds": first["window_seconds"],
        "window": window,
        "pool": {
            "saturation": max(p["saturation"] for p in pools),
            "waiting": sum(p["waiting"] for p in pools),
            "oldest_wait_seconds": max(p["oldest_wait_seconds"] for p in pools),
        },
        "baseline": {
            "p50": _max(b["p50"] for b in baselines),
            "p99": _max(b["p99"] for b in baselines),
            "error_rate": _max(b["error_rate"] for b in baselines),
            "ready": all(b["ready"] for b in baselines),
        },
        "signals": [{**sig, "worker": w} for w, snap in snapshots for sig in snap["signals"]],
    }


# --------------------------------------------------------------------------- #
# Prometheus
# --------------------------------------------------------------------------- #

#: How a gauge merges across workers; gauges not named here are added up.
GAUGE_MERGE = {
    "scry_breaker_state": "max",  # the most open of the workers' breakers
    "scry_pool_max_wait_seconds": "max",  # the longest wait anywhere
    "scry_pool_saturation": "ratio",  # recomputed: summed active / summed size
}


def merge_metrics(answers: dict[int, list[dict[str, Any]]], workers: int) -> list[Metric]:
    """The families of every worker merged sample by sample: counters and
    histograms add up (``_created`` takes the earliest), gauges per
    ``GAUGE_MERGE``. Adds ``scry_worker_up{worker}`` (1 answered, 0 not)."""
    families: dict[
        str, tuple[dict[str, Any], dict[tuple[str, tuple[tuple[str, str], ...]], float]]
    ] = {}
    for worker in sorted(answers):
        for family in answers[worker]:
            name = family["name"]
            got = families.get(name)
            if got is None:
                got = families[name] = (family, {})
            how = "sum" if family["type"] != "gauge" else GAUGE_MERGE.get(name, "sum")
            samples = got[1]
            for sample_name, labels, value in family["samples"]:
                key = (sample_name, tuple(sorted(labels.items())))
                old = samples.get(key)
                if old is None:
                    samples[key] = value
                elif sample_name.endswith("_created"):
                    samples[key] = min(old, value)
                elif how == "max":
                    samples[key] = max(old, value)
                else:
                    samples[key] = old + value
    _recompute_saturation(families)
    out = []
    for name, (family, samples) in families.items():
        metric = Metric(name, family["help"], family["type"], family.get("unit") or "")
        for (sample_name, labels), value in samples.items():
            metric.add_sample(sample_name, dict(labels), value)
        out.append(metric)
    up = Metric("scry_worker_up", "Whether a worker answered this scrape (1) or not (0).", "gauge")
    for worker in range(workers):
        up.add_sample("scry_worker_up", {"worker": str(worker)}, 1.0 if worker in answers else 0.0)
    out.append(up)
    return out


def _recompute_saturation(
    families: dict[
        str, tuple[dict[str, Any], dict[tuple[str, tuple[tuple[str, str], ...]], float]]
    ],
) -> None:
    saturation = families.get("scry_pool_saturation")
    active = families.get("scry_pool_active")
    size = families.get("scry_pool_size")
    if saturation is None or active is None or size is None:
        return
    samples = saturation[1]
    for name, labels in list(samples):
        used = active[1].get(("scry_pool_active", labels), 0.0)
        total = size[1].get(("scry_pool_size", labels), 0.0)
        samples[(name, labels)] = used / total if total else 0.0


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render_metrics(families: list[Metric]) -> bytes:
    """The Prometheus text exposition of merged families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)
