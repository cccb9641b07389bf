"""The circuit breaker's state machine, driven by an injected clock."""

from __future__ import annotations

import math

import pytest

from scry.breaker import (
    BREAKER_OPEN_SQLSTATE,
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    Transition,
    classify_sqlstate,
    condition_name,
)
from scry.config import CircuitBreakerConfig, ConfigError, load_config


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None, **overrides: object) -> CircuitBreaker:
    cfg = CircuitBreakerConfig(
        **{"failure_threshold": 5, "success_threshold": 3, "timeout_seconds": 30, **overrides}
    )
    return CircuitBreaker(cfg, name="app", now=clock or Clock(), wall=lambda: 1.7e9)


def open_breaker(breaker: CircuitBreaker, reason: str = "connection refused") -> None:
    for _ in range(breaker.failure_threshold):
        breaker.record_failure(reason)
    assert breaker.state is OPEN


# --------------------------------------------------------------------------- #
# closed
# --------------------------------------------------------------------------- #


def test_starts_closed_and_allows() -> None:
    breaker = make()
    assert breaker.state is CLOSED
    assert breaker.allow() is True
    assert breaker.rejections == 0


def test_closed_allow_does_not_read_the_clock() -> None:
    # The hot path: one identity check, no clock call, no counting.
    def clock() -> float:
        raise AssertionError("allow() read the clock in the closed state")

    breaker = CircuitBreaker(CircuitBreakerConfig(), now=clock)
    for _ in range(1000):
        assert breaker.allow()


def test_opens_at_failure_threshold() -> None:
    breaker = make()
    for _ in range(4):
        breaker.record_failure("connection refused")
    assert breaker.state is CLOSED
    assert breaker.consecutive_failures == 4
    breaker.record_failure("connection refused")
    assert breaker.state is OPEN
    assert breaker.opened_count == 1
    assert breaker.failures == 5
    last = breaker.transitions[-1]
    assert (last.from_state, last.to_state) == (CLOSED, OPEN)
    assert last.reason == "5 consecutive failures: connection refused"


def test_a_success_resets_the_consecutive_count() -> None:
    breaker = make()
    for _ in range(10):
        for _ in range(4):
            breaker.record_failure("connection refused")
        breaker.record_success()
    assert breaker.state is CLOSED
    assert breaker.consecutive_failures == 0
    assert breaker.failures == 40
    assert breaker.successes == 10


@pytest.mark.parametrize(
    "code",
    ["42601", "42P01", "42501", "23505", "23503", "22012", "22P02", "25P02", "25P03",
     "40001", "40P01", "57014", "57P05", "53400", "28P01", "3D000", "0A000", "55P03"],
)  # fmt: skip
def test_user_errors_do_not_count(code: str) -> None:
    breaker = make()
    assert classify_sqlstate(code) is False
    for _ in range(20):
        assert breaker.record_server_error(code) is False
    assert breaker.state is CLOSED
    assert breaker.failures == 0


@pytest.mark.parametrize(
    "code",
    ["08000", "08003", "08006", "08001", "53000", "53100", "53200", "53300",
     "57P01", "57P02", "57P03", "57P04", "58000", "58030", "XX000", "XX001", "XX002"],
)  # fmt: skip
def test_sick_server_errors_count(code: str) -> None:
    breaker = make()
    assert classify_sqlstate(code) is True
    for _ in range(5):
        assert breaker.record_server_error(code) is True
    assert breaker.state is OPEN
    assert breaker.open_reason == f"5 consecutive failures: {code} {condition_name(code)}"


def test_query_canceled_counts_only_for_scry_query_timeout() -> None:
    assert classify_sqlstate("57014") is False
    assert classify_sqlstate("57014", query_timeout=True) is True
    breaker = make()
    assert breaker.record_server_error("57014") is False
    assert breaker.record_server_error("57014", query_timeout=True) is True
    assert breaker.failures == 1


def test_disabled_breaker_counts_but_never_opens_by_itself() -> None:
    breaker = make(enabled=False)
    for _ in range(50):
        breaker.record_failure("connection refused")
    assert breaker.state is CLOSED
    assert breaker.failures == 50
    assert breaker.trip("predictive: latency", hold=False) is False
    assert breaker.state is CLOSED
    # An operator's trip is still obeyed.
    assert breaker.trip("maintenance") is True
    assert breaker.allow() is False


# --------------------------------------------------------------------------- #
# open
# --------------------------------------------------------------------------- #


def test_open_rejects_and_counts_rejections() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    for _ in range(7):
        assert breaker.allow() is False
    assert breaker.rejections == 7


def test_rejection_message_is_retryable_and_explains() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    clock.t += 7.2
    sqlstate, text = breaker.rejection_message("app")
    assert sqlstate == BREAKER_OPEN_SQLSTATE == "57P03"
    assert text == (
        "circuit breaker open for database app: PostgreSQL is failing "
        "(5 consecutive failures: connection refused); retry in 23 s"
    )
    assert breaker.rejection_message()[1].startswith("circuit breaker open for database app:")


def test_failures_and_successes_of_running_transactions_do_not_move_an_open_breaker() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    opened_at = breaker.opened_at
    clock.t += 10
    breaker.record_failure("connection lost")
    breaker.record_success()
    breaker.record_success()
    breaker.record_success()
    assert breaker.state is OPEN
    assert breaker.opened_at == opened_at  # the timeout is not extended
    assert breaker.opened_count == 1


def test_open_goes_half_open_after_timeout() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    clock.t += 29.9
    assert breaker.allow() is False
    assert breaker.state is OPEN
    clock.t += 0.1
    assert breaker.allow() is True  # the first probe
    assert breaker.state is HALF_OPEN
    assert breaker.probes_in_flight == 1
    assert breaker.transitions[-1].reason == "30 s timeout elapsed"


def test_tick_moves_to_half_open_without_traffic() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    clock.t += 31
    breaker.tick()
    assert breaker.state is HALF_OPEN
    assert breaker.probes_in_flight == 0


# --------------------------------------------------------------------------- #
# half-open
# --------------------------------------------------------------------------- #


def half_open(clock: Clock, **overrides: object) -> CircuitBreaker:
    breaker = make(clock, **overrides)
    open_breaker(breaker)
    clock.t += breaker.timeout_seconds
    breaker.tick()
    assert breaker.state is HALF_OPEN
    return breaker


@pytest.mark.parametrize("max_probes", [1, 2, 3])
def test_half_open_lets_a_limited_number_of_probes_through(max_probes: int) -> None:
    clock = Clock()
    breaker = half_open(clock, half_open_max_probes=max_probes)
    assert [breaker.allow() for _ in range(max_probes)] == [True] * max_probes
    rejected_before = breaker.rejections
    assert breaker.allow() is False
    assert breaker.rejections == rejected_before + 1
    sqlstate, text = breaker.rejection_message("app")
    assert sqlstate == "57P03"
    assert "half-open for database app" in text and "retry in 1 s" in text


def test_a_probe_result_frees_its_slot() -> None:
    clock = Clock()
    breaker = half_open(clock)
    assert breaker.allow() is True
    assert breaker.allow() is False
    breaker.record_success()
    assert breaker.allow() is True


def test_half_open_closes_after_success_threshold() -> None:
    clock = Clock()
    breaker = half_open(clock)
    for i in range(3):
        assert breaker.allow() is True
        breaker.record_success()
        assert breaker.state is (CLOSED if i == 2 else HALF_OPEN)
    last = breaker.transitions[-1]
    assert (last.from_state, last.to_state, last.reason) == (
        HALF_OPEN,
        CLOSED,
        "3 probes succeeded",
    )
    assert breaker.consecutive_failures == 0
    assert breaker.allow() is True


def test_half_open_reopens_on_a_failure() -> None:
    clock = Clock()
    breaker = half_open(clock)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.allow()
    breaker.record_failure("connection refused")
    assert breaker.state is OPEN
    assert breaker.opened_count == 2
    assert breaker.open_reason == "probe failed: connection refused"
    # A fresh timeout starts, and success progress is forgotten.
    clock.t += 29
    assert breaker.allow() is False
    clock.t += 1
    assert breaker.allow() is True
    assert breaker.probe_successes == 0


def test_a_silent_probe_is_reclaimed_after_the_timeout() -> None:
    clock = Clock()
    breaker = half_open(clock)
    assert breaker.allow() is True  # the client never reports back
    clock.t += 29
    assert breaker.allow() is False
    clock.t += 1
    assert breaker.allow() is True


def test_release_frees_a_probe_without_a_verdict() -> None:
    clock = Clock()
    breaker = half_open(clock)
    assert breaker.allow() is True
    breaker.release()
    assert breaker.state is HALF_OPEN
    assert breaker.allow() is True
    breaker.release()
    breaker.release()  # never below zero
    assert breaker.probes_in_flight == 0


# --------------------------------------------------------------------------- #
# manual operations, history, hooks, snapshot
# --------------------------------------------------------------------------- #


def test_manual_trip_holds_until_reset() -> None:
    clock = Clock()
    breaker = make(clock)
    assert breaker.trip("manual: failover in progress") is True
    assert breaker.state is OPEN and breaker.held
    clock.t += 3600
    breaker.tick()
    assert breaker.allow() is False
    assert breaker.state is OPEN
    assert breaker.retry_after() == math.inf
    assert breaker.snapshot()["retry_in_seconds"] is None
    sqlstate, text = breaker.rejection_message("app")
    assert sqlstate == "57P03"
    assert "tripped by an operator (manual: failover in progress)" in text
    assert breaker.trip("again") is False  # already held
    assert breaker.reset("manual: failover done") is True
    assert breaker.state is CLOSED and not breaker.held
    assert breaker.transitions[-1].reason == "manual: failover done"
    assert breaker.reset() is False  # already closed


def test_manual_trip_of_an_automatically_open_breaker_holds_it() -> None:
    clock = Clock()
    breaker = make(clock)
    open_breaker(breaker)
    assert breaker.trip("manual: keep it shut") is True
    clock.t += 100
    assert breaker.allow() is False
    assert breaker.transitions[-1].to_state is OPEN
    assert breaker.opened_count == 1


def test_predictive_trip_times_out_like_a_normal_opening() -> None:
    clock = Clock()
    breaker = make(clock)
    assert breaker.trip("predictive: p99 latency", hold=False) is True
    assert breaker.state is OPEN and not breaker.held
    assert breaker.trip("predictive: again", hold=False) is False
    clock.t += 30
    assert breaker.allow() is True
    assert breaker.state is HALF_OPEN


# --------------------------------------------------------------------------- #
# a gone server: a login ends OPEN early
# --------------------------------------------------------------------------- #


def open_on_gone(clock: Clock) -> CircuitBreaker:
    breaker = make(clock)
    for _ in range(breaker.failure_threshold):
        breaker.record_failure("connection refused", gone=True)
    assert breaker.state is OPEN and breaker.opened_on_gone
    return breaker


def test_a_login_moves_a_breaker_opened_on_a_gone_server_to_half_open() -> None:
    clock = Clock()
    breaker = open_on_gone(clock)
    assert breaker.allow() is False
    assert breaker.retry_after() == 1.0  # the proxy tries a login every second
    assert "retry in 1 s" in breaker.rejection_message()[1]
    assert breaker.snapshot()["ends_on_login"] is True
    clock.t += 2
    assert breaker.login_succeeded() is True
    assert breaker.state is HALF_OPEN
    assert breaker.transitions[-1].reason == "a server login succeeded"
    assert breaker.snapshot()["ends_on_login"] is False
    # From here the probes decide, as after a timeout.
    for _ in range(breaker.success_threshold):
        assert breaker.allow() is True
        breaker.record_success()
    assert breaker.state is CLOSED
    assert breaker.login_succeeded() is False


def test_shutdown_and_connection_errors_say_the_server_is_gone() -> None:
    for code in ("57P01", "57P02", "57P03", "08006"):
        breaker = make()
        for _ in range(breaker.failure_threshold):
            breaker.record_server_error(code)
        assert breaker.opened_on_gone, code
    for code in ("XX000", "53100", "58030", "53300"):
        breaker = make()
        for _ in range(breaker.failure_threshold):
            breaker.record_server_error(code)
        assert breaker.state is OPEN and not breaker.opened_on_gone, code
        assert breaker.login_succeeded() is False
        assert breaker.state is OPEN


def test_a_streak_is_gone_only_if_every_failure_in_it_is() -> None:
    breaker = make()
    breaker.record_failure("XX000 could not read block")
    for _ in range(breaker.failure_threshold - 1):
        breaker.record_failure("server connection lost", gone=True)
    assert breaker.state is OPEN and not breaker.opened_on_gone
    assert breaker.login_succeeded() is False
    # A success starts a new streak.
    breaker = make()
    breaker.record_failure("XX000 could not read block")
    breaker.record_success()
    for _ in range(breaker.failure_threshold):
        breaker.record_failure("server connection lost", gone=True)
    assert breaker.opened_on_gone


def test_a_login_does_not_end_a_predictive_or_manual_opening() -> None:
    clock = Clock()
    breaker = make(clock)
    breaker.trip("predictive: p99 latency", hold=False)
    assert breaker.login_succeeded() is False
    assert breaker.retry_after() == 30
    breaker = open_on_gone(clock)
    breaker.trip("maintenance")  # an operator holds it
    assert breaker.login_succeeded() is False
    assert breaker.state is OPEN


def test_a_probe_that_cannot_log_in_reopens_on_gone() -> None:
    clock = Clock()
    breaker = open_on_gone(clock)
    breaker.login_succeeded()
    assert breaker.allow() is True
    breaker.record_failure("connection refused", gone=True)
    assert breaker.state is OPEN and breaker.opened_on_gone
    assert breaker.login_succeeded() is True
    # ... but a probe that fails on a sick server waits for the timeout.
    assert breaker.allow() is True
    breaker.record_server_error("XX001")
    assert breaker.state is OPEN and not breaker.login_succeeded()


def test_a_peer_trip_carries_whether_the_server_was_gone() -> None:
    breaker = make()
    breaker.trip("worker 1: 5 consecutive failures: connection refused", hold=False, gone=True)
    assert breaker.login_succeeded() is True


def test_reset_from_half_open_and_forgets_the_streak() -> None:
    clock = Clock()
    breaker = half_open(clock)
    breaker.reset()
    assert breaker.state is CLOSED
    for _ in range(4):
        breaker.record_failure("x")
    assert breaker.state is CLOSED


def test_transition_history_is_bounded() -> None:
    clock = Clock()
    breaker = CircuitBreaker(CircuitBreakerConfig(), now=clock, history=4)
    for i in range(10):
        breaker.trip(f"trip {i}")
        breaker.reset(f"reset {i}")
    assert len(breaker.transitions) == 4
    assert [t.reason for t in breaker.transitions] == ["trip 8", "reset 8", "trip 9", "reset 9"]


def test_on_transition_hook_sees_every_change_and_cannot_break_the_breaker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    seen: list[Transition] = []
    breaker = make(clock)
    breaker.on_transition = lambda b, t: seen.append(t)
    open_breaker(breaker)
    clock.t += 30
    breaker.allow()
    breaker.record_success()
    breaker.record_success()
    breaker.record_success()
    assert [(t.from_state, t.to_state) for t in seen] == [
        (CLOSED, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, CLOSED),
    ]

    def broken(b: CircuitBreaker, t: Transition) -> None:
        raise RuntimeError("metrics exploded")

    breaker.on_transition = broken
    open_breaker(breaker)  # does not raise
    assert breaker.state is OPEN
    assert "on_transition hook failed" in caplog.text


def test_snapshot_for_the_admin_api() -> None:
    clock = Clock()
    breaker = make(clock)
    breaker.record_success()
    open_breaker(breaker)
    breaker.allow()
    clock.t += 12
    snap = breaker.snapshot()
    assert snap["name"] == "app"
    assert snap["state"] == "open"
    assert snap["held"] is False
    assert snap["open_reason"] == "5 consecutive failures: connection refused"
    assert snap["retry_in_seconds"] == 18
    assert snap["counters"] == {
        "failures": 5,
        "successes": 1,
        "rejections": 1,
        "consecutive_failures": 5,
        "opened": 1,
    }
    assert snap["config"]["half_open_max_probes"] == 1
    assert snap["transitions"] == [
        {
            "at": 1.7e9,
            "seconds_ago": 12,
            "from": "closed",
            "to": "open",
            "reason": "5 consecutive failures: connection refused",
        }
    ]
    # The snapshot applies the timeout too, so the admin API never shows a stale state.
    clock.t += 20
    assert breaker.snapshot()["state"] == "half_open"


ENV = {"SCRY_DATABASE_URL": "postgres://u@db.internal/app"}


def test_config_fields() -> None:
    cfg = load_config(None, env=ENV, overrides={"circuit_breaker.half_open_max_probes": 3})
    assert cfg.circuit_breaker.half_open_max_probes == 3
    assert CircuitBreakerConfig().half_open_max_probes == 1
    with pytest.raises(ConfigError, match="half_open_max_probes"):
        load_config(None, env=ENV, overrides={"circuit_breaker.half_open_max_probes": 0})


def test_protocol_violation_is_the_clients_fault() -> None:
    # PostgreSQL answers a client's malformed message with 08P01: no sign of sickness.
    assert classify_sqlstate("08P01") is False
