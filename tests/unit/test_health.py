"""The health monitor's windows, baseline and rules, driven by an injected clock."""

from __future__ import annotations

import pytest

from scry import health as health_module
from scry.breaker import classify_sqlstate
from scry.config import ConfigError, HealthConfig, load_config
from scry.health import (
    CRITICAL,
    ERROR_RATE,
    LATENCY_SPIKE,
    N_BUCKETS,
    SATURATION,
    STARVATION,
    WARNING,
    HealthMonitor,
    Signal,
    latency_bucket,
)


class Clock:
    def __init__(self, t: float = 5000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, **overrides: object) -> HealthMonitor:
    return HealthMonitor(HealthConfig(**overrides), name="app", now=clock)


def run(
    monitor: HealthMonitor,
    clock: Clock,
    seconds: int,
    *,
    qps: int = 200,
    latency: float = 0.010,
    errors: int = 0,
) -> list[Signal]:
    """Feed ``seconds`` of traffic, evaluating at each second boundary as the tick does."""
    signals: list[Signal] = []
    for _ in range(seconds):
        for i in range(qps):
            monitor.observe_query(latency, is_error=i < errors)
        clock.t += 1
        signals = monitor.evaluate()
    return signals


def names(signals: list[Signal]) -> set[str]:
    return {s.name for s in signals}


# --------------------------------------------------------------------------- #
# windows and percentiles
# --------------------------------------------------------------------------- #


def test_buckets_are_monotonic_and_bounded() -> None:
    values = [0.0, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0, 100.0, 1e4]
    buckets = [latency_bucket(v) for v in values]
    assert buckets == sorted(buckets)
    assert buckets[0] == 0 and buckets[-1] == N_BUCKETS - 1


def test_percentiles_are_within_ten_percent() -> None:
    clock = Clock()
    monitor = make(clock)
    for i in range(1, 1001):
        monitor.observe_query(i / 1000)  # 1 ms .. 1 s, uniform
    clock.t += 1
    monitor.evaluate()
    stats = monitor.window_stats
    assert stats["queries"] == 1000
    assert stats["p50"] == pytest.approx(0.5, rel=0.1)
    assert stats["p99"] == pytest.approx(0.99, rel=0.1)


def test_window_forgets_old_seconds() -> None:
    clock = Clock()
    monitor = make(clock, window_seconds=10)
    run(monitor, clock, 5, qps=100)
    assert monitor.window_stats["queries"] == 500
    run(monitor, clock, 10, qps=10)
    assert monitor.window_stats["queries"] == 100
    clock.t += 60  # idle for longer than the window
    monitor.evaluate()
    assert monitor.window_stats["queries"] == 0
    assert monitor.window_stats["p99"] == 0.0


def test_errors_carry_no_latency() -> None:
    clock = Clock()
    monitor = make(clock)
    for _ in range(100):
        monitor.observe_query(0.002)
        monitor.observe_query(15.0, is_error=True)  # a connect timeout
    clock.t += 1
    monitor.evaluate()
    assert monitor.window_stats["error_rate"] == 0.5
    assert monitor.window_stats["p99"] == pytest.approx(0.002, rel=0.1)


# --------------------------------------------------------------------------- #
# latency spike
# --------------------------------------------------------------------------- #


def test_steady_latency_with_a_stream_of_user_errors_fires_nothing() -> None:
    clock = Clock()
    monitor = make(clock, predictive=True)
    run(monitor, clock, 60)
    for _ in range(120):
        for i in range(200):
            if i % 2:  # half the queries are syntax errors, answered fast
                monitor.observe_query(0.0003, is_error=classify_sqlstate("42601"))
            else:
                monitor.observe_query(0.010)
        clock.t += 1
        assert monitor.evaluate() == []
    assert monitor.should_open() is None


def test_a_sustained_10x_latency_jump_fires_then_turns_critical() -> None:
    clock = Clock()
    monitor = make(clock, predictive=True, sustain_seconds=15)
    assert run(monitor, clock, 60, latency=0.010) == []
    assert monitor.baseline_p99 == pytest.approx(0.010, rel=0.1)

    signals = run(monitor, clock, 1, latency=0.100)
    assert names(signals) == {LATENCY_SPIKE}
    (spike,) = signals
    assert spike.severity == WARNING
    assert spike.value == pytest.approx(0.100, rel=0.1)
    assert spike.threshold == pytest.approx(0.050)  # the floor beats 3 x 10 ms
    assert "p99 latency" in spike.message
    assert monitor.should_open() is None  # not sustained yet

    signals = run(monitor, clock, 14, latency=0.100)
    assert signals[0].severity == WARNING
    signals = run(monitor, clock, 1, latency=0.100)
    assert signals[0].severity == CRITICAL
    reason = monitor.should_open()
    assert reason is not None and reason.startswith("predictive: p99 latency 10")


def test_should_open_needs_predictive_mode() -> None:
    clock = Clock()
    monitor = make(clock, predictive=False)
    run(monitor, clock, 60, latency=0.010)
    signals = run(monitor, clock, 30, latency=0.100)
    assert signals[0].severity == CRITICAL
    assert monitor.should_open() is None


def test_a_short_burst_never_turns_critical() -> None:
    clock = Clock()
    monitor = make(clock, predictive=True)
    run(monitor, clock, 60, latency=0.010)
    run(monitor, clock, 3, latency=0.200)
    for _ in range(30):
        signals = run(monitor, clock, 1, latency=0.010)
        assert all(s.severity == WARNING for s in signals)
        assert monitor.should_open() is None
    assert signals == []


def test_below_the_absolute_floor_is_not_a_spike() -> None:
    clock = Clock()
    monitor = make(clock, latency_floor_ms=50)
    run(monitor, clock, 60, latency=0.001)
    assert run(monitor, clock, 30, latency=0.010) == []  # 10x, but 10 ms is fine


def test_the_baseline_adapts_to_a_permanent_shift_within_a_half_life() -> None:
    clock = Clock()
    monitor = make(clock, baseline_half_life_seconds=60)
    run(monitor, clock, 120, latency=0.010)
    assert names(run(monitor, clock, 2, latency=0.100)) == {LATENCY_SPIKE}
    signals = run(monitor, clock, 58, latency=0.100)
    assert signals == []
    assert monitor.baseline_p99 is not None and monitor.baseline_p99 > 0.05


def test_no_latency_judgement_before_min_samples_or_a_baseline() -> None:
    clock = Clock()
    monitor = make(clock, min_samples=50)
    # A fresh monitor has no baseline yet: no spike however slow.
    assert run(monitor, clock, 5, latency=2.0) == []
    monitor = make(clock, min_samples=50)
    run(monitor, clock, 60, qps=100, latency=0.010)
    assert run(monitor, clock, 30, qps=2, latency=1.0) == []  # 20 per window


# --------------------------------------------------------------------------- #
# error rate
# --------------------------------------------------------------------------- #


def test_error_rate_anomaly_fires_and_turns_critical() -> None:
    clock = Clock()
    monitor = make(clock, predictive=True, sustain_seconds=15)
    run(monitor, clock, 60)
    assert run(monitor, clock, 30, errors=4) == []  # 2 % sick errors: below the floor
    # Half the queries fail: with the 2 % before, the 10 s window passes the
    # 10 % floor in the second second (7 %, then 12 %).
    assert run(monitor, clock, 1, errors=100) == []
    signals = run(monitor, clock, 1, errors=100)
    assert names(signals) == {ERROR_RATE}
    assert signals[0].severity == WARNING
    signals = run(monitor, clock, 15, errors=100)
    (error,) = [s for s in signals if s.name == ERROR_RATE]
    assert error.severity == CRITICAL
    assert error.value == pytest.approx(0.5, abs=0.05)
    assert error.threshold == pytest.approx(0.1)
    reason = monitor.should_open()
    assert reason is not None and "failed with server errors" in reason


def test_error_rate_threshold_follows_the_baseline() -> None:
    clock = Clock()
    monitor = make(clock, baseline_half_life_seconds=30)
    run(monitor, clock, 300, errors=30)  # a chronic 15 % becomes "normal"
    assert monitor.baseline_error_rate == pytest.approx(0.15, abs=0.01)
    assert run(monitor, clock, 10, errors=40) == []  # 20 % < 3 x 15 %
    assert names(run(monitor, clock, 8, errors=200)) == {ERROR_RATE}


# --------------------------------------------------------------------------- #
# pool: saturation and starvation
# --------------------------------------------------------------------------- #


def test_saturation_with_waiting_clients_is_reported_once_sustained() -> None:
    clock = Clock()
    monitor = make(clock, sustain_seconds=15, predictive=True)
    for second in range(20):
        monitor.observe_pool_state(0.95, 4, 0.2)
        clock.t += 1
        signals = monitor.evaluate()
        assert (SATURATION in names(signals)) is (second >= 15)
    (saturation,) = signals
    assert saturation.severity == WARNING
    assert "95% busy with 4 clients waiting" in saturation.message
    assert monitor.should_open() is None  # the pool's trouble, not the server's


def test_a_full_pool_without_waiters_is_not_saturated() -> None:
    clock = Clock()
    monitor = make(clock, sustain_seconds=5)
    for _ in range(20):
        monitor.observe_pool(0.0, 1.0, 0)
        clock.t += 1
        assert monitor.evaluate() == []


def test_starvation_from_a_finished_wait_and_from_a_waiting_client() -> None:
    clock = Clock()
    monitor = make(clock, starvation_seconds=5, window_seconds=10, predictive=True)
    monitor.observe_pool(0.5, 0.5, 0)
    clock.t += 1
    assert monitor.evaluate() == []

    monitor.observe_pool(6.2, 1.0, 3)
    clock.t += 1
    (starving,) = monitor.evaluate()
    assert (starving.name, starving.severity) == (STARVATION, CRITICAL)
    assert starving.value == pytest.approx(6.2)
    assert monitor.should_open() is None
    clock.t += 11  # the long wait leaves the window
    assert monitor.evaluate() == []

    # Nobody gets a server, so no acquisition reports: the tick's gauge tells.
    monitor.observe_pool_state(1.0, 12, 7.5)
    clock.t += 1
    assert names(monitor.evaluate()) == {STARVATION}


# --------------------------------------------------------------------------- #
# observability and config
# --------------------------------------------------------------------------- #


def test_snapshot_for_the_admin_api() -> None:
    clock = Clock()
    monitor = make(clock)
    run(monitor, clock, 30)
    run(monitor, clock, 3, latency=0.200)
    snap = monitor.snapshot()
    assert snap["name"] == "app"
    assert snap["window"]["queries"] == 2000
    assert snap["window"]["qps"] == 200
    assert snap["baseline"]["ready"] is True
    assert snap["baseline"]["p99"] == pytest.approx(0.010, rel=0.3)
    (signal,) = snap["signals"]
    assert signal["name"] == LATENCY_SPIKE and signal["for_seconds"] == 2


def test_health_config_defaults_and_validation() -> None:
    cfg = HealthConfig()
    assert (cfg.window_seconds, cfg.sustain_seconds, cfg.min_samples) == (10, 15, 50)
    assert cfg.sustain_seconds > cfg.window_seconds
    env = {"SCRY_DATABASE_URL": "postgres://u@db.internal/app", "SCRY_HEALTH__PREDICTIVE": "true"}
    loaded = load_config(None, env=env, overrides={"health.latency_spike_factor": 5})
    assert loaded.health.predictive is True
    assert loaded.health.latency_spike_factor == 5
    with pytest.raises(ConfigError, match="latency_spike_factor"):
        load_config(None, env=env, overrides={"health.latency_spike_factor": 1})
    with pytest.raises(ConfigError, match="did you mean 'sustain_seconds'"):
        load_config(None, env=env, overrides={"health.sustain_second": 3})


def test_observe_latencies_counts_like_observe_query() -> None:
    """The drain's batch feed fills the same buckets as one call per query."""
    import random

    rng = random.Random(11)
    clock = Clock()
    one, many = make(clock), make(clock)
    latencies = [0, 1, 999, 10_000, 11_000, 11_999, 10**15, -3] + [
        int(rng.lognormvariate(13, 3)) for _ in range(20_000)
    ]
    edges = health_module._BUCKET_FLOOR_NS  # either side of every bucket's floor
    latencies += [edge + d for edge in edges for d in (-1, 0, 1)] + [edges[5]] * 50
    for latency in latencies:
        one.observe_query((latency // 1000) / 1e6)
    for _ in range(7):
        one.observe_query(0.5, is_error=True)
    many.observe_latencies(latencies[:100], 3)
    many.observe_latencies(latencies[100:], 4)
    many.observe_latencies([], 0)
    assert many._count == one._count and many._errors == one._errors
    assert many._hist == one._hist


# --------------------------------------------------------------------------- #
# workers: sharing windows
# --------------------------------------------------------------------------- #


def test_workers_that_share_their_seconds_judge_the_instance_s_traffic() -> None:
    """Three workers each see a third of a sick database's traffic, below
    min_samples alone: sharing their seconds, each sees all of it and fires."""
    clock = Clock()
    cfg = {"min_samples": 100, "window_seconds": 5}
    workers = [HealthMonitor(HealthConfig(**cfg), name="app", now=clock, shared=True)
               for _ in range(3)]  # fmt: skip
    alone = HealthMonitor(HealthConfig(**cfg), name="app", now=clock)

    def second(errors: int) -> list[list[Signal]]:
        for monitor in (*workers, alone):
            for i in range(15):  # 15 a second each: 75 a window alone, 225 shared
                monitor.observe_query(0.002, is_error=i < errors)
        clock.t += 1
        taken = [monitor.take_unshared(int(clock.t)) for monitor in workers]
        for i, monitor in enumerate(workers):
            for j, seconds in enumerate(taken):
                if i != j:
                    for sec, count, errs, buckets in seconds:
                        monitor.merge(sec, count, errs, buckets)
        return [monitor.evaluate() for monitor in workers]

    for _ in range(8):  # a healthy baseline
        second(errors=0)
    assert workers[0].window_stats["queries"] == 3 * 15 * 5
    for _ in range(4):
        judged = second(errors=15)
    assert all(ERROR_RATE in names(signals) for signals in judged)
    assert ERROR_RATE not in names(alone.evaluate())  # (75 a window: below min_samples)
    assert all(not monitor.take_unshared(int(clock.t) + 1) for monitor in workers)


def test_merge_ignores_seconds_outside_the_window() -> None:
    clock = Clock()
    monitor = make(clock, window_seconds=5)
    now = int(clock.t)
    monitor.merge(now - 10, 50, 0, {3: 50})  # older than the window
    monitor.merge(now + 5, 50, 0, {3: 50})  # not come yet here
    clock.t += 1
    monitor.evaluate()
    assert monitor.window_stats["queries"] == 0
    monitor.merge(now, 50, 5, {3: 45})
    monitor.evaluate()
    assert (monitor.window_stats["queries"], monitor.window_stats["errors"]) == (50, 5)


def test_take_unshared_hands_out_whole_seconds_once() -> None:
    clock = Clock()
    monitor = HealthMonitor(HealthConfig(), name="app", now=clock, shared=True)
    monitor.observe_query(0.001)
    monitor.observe_latencies([2_000_000, 3_000_000], errors=1)
    assert monitor.take_unshared(int(clock.t)) == []  # (the current second is not done)
    clock.t += 1
    monitor.observe_query(0.001)
    ((sec, count, errors, buckets),) = monitor.take_unshared(int(clock.t))
    assert (sec, count, errors) == (int(clock.t) - 1, 4, 1) and sum(buckets.values()) == 3
    assert monitor.take_unshared(int(clock.t)) == []
    assert HealthMonitor(HealthConfig(), now=clock).take_unshared(int(clock.t) + 5) == []
