"""The console's pure parts: formatting, targets and fleet files, merges, the action registry."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from rich.text import Text

from admin import TopQueries, TopQuery
from scry_tui import fmt
from scry_tui.actions import ACTIONS, VIEW_IDS, bindings, view_for
from scry_tui.model import ProxyState, TopTracker, merge_top, top_fetch_limit, top_rows
from scry_tui.targets import TargetError, load_fleet, make_target, parse_ssh, resolve_targets
from scry_tui.testing import FakeAdmin


def test_ms_count_duration_formats() -> None:
    assert fmt.ms(None) == "–"
    assert fmt.ms(0.123) == "0.12"
    assert fmt.ms(12.34) == "12.3"
    assert fmt.ms(123.4) == "123"
    assert fmt.ms(12_345) == "12.3s"
    assert fmt.count(999) == "999"
    assert fmt.count(12_345) == "12.3k"
    assert fmt.count(4_500_000) == "4.5M"
    assert fmt.duration(45) == "45s"
    assert fmt.duration(192) == "3m12s"
    assert fmt.duration(7500) == "2h05m"
    assert fmt.clock(0, dt.UTC, millis=True) == "00:00:00.000"


def test_sparkline_and_bar() -> None:
    assert fmt.sparkline([]) == ""
    assert fmt.sparkline([0, 0]) == "▁▁"
    line = fmt.sparkline([1, 2, 3, 4, 5, 6, 7, 8])
    assert line[0] == "▁" and line[-1] == "█" and len(line) == 8
    assert len(fmt.sparkline(range(100), width=16)) == 16
    assert fmt.bar(1.0, 4) == "████"
    assert fmt.bar(0.0, 4) == "    "
    assert fmt.bar(0.5, 4) == "██  "


def test_deltas_and_rank_changes() -> None:
    assert fmt.delta_arrow(None, 3).plain == " "
    assert fmt.delta_arrow(10, 20).plain == "↑"
    assert fmt.delta_arrow(10, 5).plain == "↓"
    assert fmt.delta_arrow(10, 10.5).plain == "·"
    assert fmt.rank_change(None, 1).plain == "new"
    assert fmt.rank_change(4, 2).plain == "↑2"
    assert fmt.rank_change(1, 3).plain == "↓2"


def test_histogram_buckets_double() -> None:
    buckets = fmt.histogram([0.3, 0.4, 1.0, 5.0, 300.0])
    assert sum(c for _, c in buckets) == 5
    assert buckets[0][1] == 2  # 0.3 and 0.4 share the first bucket (< 0.5)
    assert fmt.histogram([]) == []


def test_targets_forms() -> None:
    t = make_target("db1:6480")
    assert t.url == "http://db1:6480" and t.name == "db1:6480" and t.ssh is None
    assert make_target("https://db1:6480", name="x").url == "https://db1:6480"
    s = make_target("ssh://ops@bastion:2222/127.0.0.1:6480")
    assert s.ssh is not None and s.name == "bastion"
    assert (s.ssh.user, s.ssh.host, s.ssh.port, s.ssh.admin_host, s.ssh.admin_port) == (
        "ops", "bastion", 2222, "127.0.0.1", 6480,
    )  # fmt: skip
    assert str(s.ssh) == "ssh://ops@bastion:2222/127.0.0.1:6480"
    assert parse_ssh("ssh://h/[::1]:6480").admin_host == "::1"
    for bad in ("ftp://x:1", "nohost", "ssh://bastion", "ssh://bastion/127.0.0.1"):
        with pytest.raises(TargetError):
            make_target(bad)


def test_fleet_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EU_TOKEN", "s3cret")
    (tmp_path / "tok").write_text("filetoken\n")
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"""
refresh: 5
read_only: true
proxies:
  - name: eu
    target: http://10.0.0.5:6480
    token_env: EU_TOKEN
  - name: us
    target: ssh://ops@bastion/127.0.0.1:6480
    token_file: {tmp_path / "tok"}
  - 10.0.0.9:6480
"""
    )
    fleet = load_fleet(path)
    assert [t.name for t in fleet.targets] == ["eu", "us", "10.0.0.9:6480"]
    assert fleet.targets[0].token == "s3cret"
    assert fleet.targets[1].token == "filetoken" and fleet.targets[1].ssh is not None
    assert fleet.refresh == 5 and fleet.read_only is True
    path.write_text("proxies: {a: 'h:1', b: {target: 'h:2', token: t}}")
    fleet = load_fleet(path)
    assert [(t.name, t.url, t.token) for t in fleet.targets] == [
        ("a", "http://h:1", None), ("b", "http://h:2", "t"),
    ]  # fmt: skip
    path.write_text("proxies: [{name: a}]")
    with pytest.raises(TargetError, match=r"proxies\[0\]: needs `target:`"):
        load_fleet(path)


def test_resolve_targets_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SCRY_FLEET", raising=False)
    monkeypatch.setenv("SCRY_ADMIN_TOKEN", "envtoken")
    fleet = resolve_targets(None)
    assert [t.url for t in fleet.targets] == ["http://127.0.0.1:6480"]
    assert fleet.targets[0].token == "envtoken"
    two = resolve_targets(["a:1", "a:1"])
    assert [t.name for t in two.targets] == ["a:1", "a:1#2"]
    conf = tmp_path / ".config" / "scry"
    conf.mkdir(parents=True)
    (conf / "fleet.yaml").write_text("proxies: [{name: home, target: 'h:9'}]")
    assert [t.name for t in resolve_targets(None).targets] == ["home"]


def _q(fp: str, calls: int, total: float, p99: float) -> TopQuery:
    mean = total / calls
    return TopQuery(
        fingerprint=fp, query=f"SELECT {fp}", calls=calls, errors=0, rows=calls, total_ms=total,
        mean_ms=mean, min_ms=mean, max_ms=p99, p50_ms=mean, p95_ms=p99, p99_ms=p99, share=0.0,
        queue_ms_mean=0.1, backend_ms_mean=mean - 0.1, total_ms_mean=mean, first_seen=0, last_seen=1,
    )  # fmt: skip


def _state(name: str, queries: list[TopQuery]) -> ProxyState:
    fake = FakeAdmin(name)
    from admin import Status, TopQueries

    state = ProxyState(name=name, display=name)
    state.record_ok(
        {
            "status": Status.model_validate(fake.status()),
            "top": TopQueries(by="total_time", window_seconds=None, limit=50, queries=queries),
        },
        wall=0,
        mono=0,
    )
    return state


def test_merge_top_by_fingerprint() -> None:
    a = _state("a", [_q("x", 10, 100.0, 30.0), _q("y", 1, 500.0, 500.0)])
    b = _state("b", [_q("x", 30, 100.0, 50.0)])
    merged = merge_top([a, b], "total_time")
    assert [q.fingerprint for q in merged] == ["y", "x"]
    x = merged[1]
    assert x.calls == 40 and x.total_ms == 200.0 and x.mean_ms == 5.0
    assert x.p99_ms == 50.0  # the worst proxy's: percentiles do not add
    assert abs(sum(q.share for q in merged) - 1.0) < 1e-9
    assert [q.fingerprint for q in merge_top([a, b], "calls")] == ["x", "y"]
    assert [q.fingerprint for q in merge_top([a, b], "mean")] == ["y", "x"]


def test_merge_top_adds_the_proxies_histograms() -> None:
    """One slow call on proxy a, 199 fast ones on b: the fleet's p99 is fast,
    though a's own p99 is the slow call. A proxy that sends no histogram
    (older) leaves the worst proxy's p99, an upper bound."""
    slow = _q("x", 1, 500.0, 500.0).model_copy(update={"histogram": [(500.0, 1)]})
    fast = _q("x", 199, 199.0, 1.0).model_copy(update={"histogram": [(0.5, 100), (1.0, 99)]})
    x = merge_top([_state("a", [slow]), _state("b", [fast])], "total_time")[0]
    assert (x.p50_ms, x.p95_ms, x.p99_ms) == (0.5, 1.0, 1.0)
    assert x.histogram == [(0.5, 100), (1.0, 99), (500.0, 1)] and x.max_ms == 500.0
    older = fast.model_copy(update={"histogram": None})
    x = merge_top([_state("a", [slow]), _state("b", [older])], "total_time")[0]
    assert x.p99_ms == 500.0 and x.histogram is None


def test_top_tracker_rates() -> None:
    tracker = TopTracker()
    tracker.update([_q("x", 10, 10.0, 1.0)], mono=100.0)
    assert tracker.calls_per_s("x") is None
    tracker.update([_q("x", 30, 30.0, 1.0)], mono=102.0)
    assert tracker.calls_per_s("x") == 10.0


def test_action_registry_feeds_bindings() -> None:
    ids = [a.id for a in ACTIONS]
    assert len(ids) == len(set(ids)), "binding ids are unique"
    keys = [k for a in ACTIONS for k in a.keys.split(",")]
    assert len(keys) == len(set(keys)), "no key is bound twice"
    assert {b.id for b in bindings()} == set(ids)
    assert all(a.help and a.description for a in ACTIONS)
    # Every view has a number key, and every destructive action is confirmed by name.
    assert [a.keys for a in ACTIONS if a.id.startswith("view.")] == [
        str(i) for i in range(1, len(VIEW_IDS) + 1)
    ]
    assert {a.id for a in ACTIONS if a.destructive} == {
        "pins.unpin", "pools.kill", "breaker.trip", "breaker.reset",
    }  # fmt: skip
    assert view_for(":Top") == "top" and view_for("po") == "pools" and view_for("nope") is None


def test_text_cells_render() -> None:
    assert isinstance(fmt.breaker_text("half_open"), Text)
    assert "half-open" in fmt.breaker_text("half_open").plain


def _ranking(name: str, totals: dict[str, float], limit: int) -> ProxyState:
    """A proxy's answer to top?by=total_time&limit=``limit``."""
    state = _state(name, [])
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:limit]
    state.top = TopQueries(
        by="total_time", window_seconds=None, limit=limit,
        queries=[_q(fp, 10, total, 1.0) for fp, total in ranked],
    )  # fmt: skip
    return state


def test_a_fingerprint_just_below_every_proxys_list_is_fetched() -> None:
    """'z' is 51st on both proxies but first in the fleet: the console asks
    for deeper lists until the merged top 50 is settled, and then shows it."""
    a_totals = {f"a{i}": 100.0 - i for i in range(50)} | {"z": 50.5}
    b_totals = {f"b{i}": 100.0 - i for i in range(50)} | {"z": 50.5}
    shallow = [_ranking("a", a_totals, 50), _ranking("b", b_totals, 50)]
    assert "z" not in [r.query.fingerprint for r in top_rows(shallow, "total_time", {}, 50)]
    assert top_fetch_limit(shallow, "total_time", 50, 50) == 100
    deep = [_ranking("a", a_totals, 100), _ranking("b", b_totals, 100)]
    rows = top_rows(deep, "total_time", {}, 50)
    assert len(rows) == 50 and rows[0].query.fingerprint == "z"
    assert rows[0].query.total_ms == 101.0
    # Settled at 100 rows; 50 would not settle it: stay.
    assert top_fetch_limit(deep, "total_time", 50, 100) == 100


def test_the_fetch_limit_falls_back_when_fewer_rows_settle_the_merge() -> None:
    same = {f"q{i}": 1000.0 - i for i in range(300)}
    deep = [_ranking("a", same, 400), _ranking("b", same, 400)]
    assert top_fetch_limit(deep, "total_time", 50, 100) == 200
    # Lists shorter than asked are whole: nothing was left out.
    few = [_ranking("a", {"x": 1.0}, 50), _ranking("b", {"y": 2.0}, 50)]
    assert top_fetch_limit(few, "total_time", 50, 50) == 50
    # One proxy, or a ranking the answers were not for: as many as now.
    assert top_fetch_limit(deep[:1], "total_time", 50, 100) == 100
    assert top_fetch_limit(deep, "calls", 50, 100) == 100
    # Never past the API's page size.
    crowded = [_ranking(n, {f"{n}{i}": 1.0 for i in range(2000)}, 1000) for n in "ab"]
    assert top_fetch_limit(crowded, "total_time", 50, 1000) == 1000


def test_a_merged_share_is_of_all_the_proxies_time() -> None:
    """Each proxy's share is of its own total, rows it did not list included:
    the merged share is of the fleet's total, not of the listed rows'."""
    a = _state("a", [_q("x", 10, 100.0, 1.0).model_copy(update={"share": 0.5})])  # a: 200 ms
    b = _state("b", [_q("x", 10, 100.0, 1.0).model_copy(update={"share": 0.25})])  # b: 400 ms
    (x,) = merge_top([a, b], "total_time")
    assert x.total_ms == 200.0 and abs(x.share - 200.0 / 600.0) < 1e-9
