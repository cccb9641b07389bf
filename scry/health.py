"""The health monitor: is a database getting sick before it starts failing outright?

One :class:`HealthMonitor` per database (per backend host), per worker, fed
from the proxy:

* :meth:`HealthMonitor.observe_query` once per completed query, O(1): a
  counter and a fixed log-bucket latency histogram in the current one-second
  slot of a ring of ``window_seconds`` slots (or
  :meth:`HealthMonitor.observe_latencies` for many at once: the proxy feeds
  the observability drain's groups of statements that way);
* :meth:`HealthMonitor.observe_pool` once per server acquisition, and
  :meth:`HealthMonitor.observe_pool_state` once per second;
* :meth:`HealthMonitor.evaluate` once per second, off the hot path: sums the
  window, compares it with a baseline (an EWMA of past windows with
  ``baseline_half_life_seconds``) and raises :class:`Signal` objects.

With several workers (``shared=True``) each monitor also hands out what it
observed, second by second (:meth:`HealthMonitor.take_unshared`, sent by
scry.peering), and adds in what the other workers observed
(:meth:`HealthMonitor.merge`): every worker judges the instance's traffic,
so a database that is sick only in aggregate is noticed. (The workers of an
instance share the host's monotonic clock, so their seconds line up.) Pool
gauges and waits stay each worker's own: pools are per worker.

Rules (thresholds under ``health:`` in the config; reasoning in docs/breaker.md):

``latency_spike``
    window p99 > ``latency_spike_factor`` x baseline p99 and > ``latency_floor_ms``.
``error_rate``
    share of server-sickness errors > max(``error_rate_floor``,
    ``error_rate_factor`` x baseline rate).
``saturation``
    pool busy >= ``saturation_threshold`` with clients waiting, for ``sustain_seconds``.
``starvation``
    a client waited > ``starvation_seconds`` for a server in the window.

Latency and error-rate signals are ``warning`` when they appear and
``critical`` once held for ``sustain_seconds``; with ``health.predictive:
true`` a critical one makes :meth:`HealthMonitor.should_open` name a reason
to open the breaker. Saturation and starvation never open it: they may only
mean the pool is too small, and refusing clients would not help the server.

Errors: only server-sickness errors (those ``scry.breaker.classify_sqlstate``
accepts, connection loss, query timeouts) should be passed as ``is_error``.
A deploy that ships a typo'd query is that application's bug; counting it
would let one application's syntax errors shut a database for everyone.
Error samples carry no latency: how fast a failure came back says nothing
about how the server serves queries, and a timeout would make p99 track the
timeout setting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scry.config import HealthConfig
from scry.observe.histogram import BucketBounds, add_ns

__all__ = [
    "CRITICAL",
    "ERROR_RATE",
    "LATENCY_SPIKE",
    "SATURATION",
    "STARVATION",
    "WARNING",
    "HealthMonitor",
    "Signal",
    "latency_bucket",
]

LATENCY_SPIKE = "latency_spike"
ERROR_RATE = "error_rate"
SATURATION = "saturation"
STARVATION = "starvation"
WARNING = "warning"
CRITICAL = "critical"

# Rules whose sustained firing means the server (not the pool) is sick.
_PREDICTIVE_RULES = (LATENCY_SPIKE, ERROR_RATE)

# Latency histogram: 4 buckets per octave (each ~19 % wide, so a percentile
# is within ~9 % of the truth) from 10 us to 10 us x 2^24 (~168 s); bucket 0
# holds anything faster, the last one anything slower.
LATENCY_MIN = 1e-5
_PER_OCTAVE = 4
_OCTAVES = 24
N_BUCKETS = _PER_OCTAVE * _OCTAVES + 2
_INV_MIN = 1 / LATENCY_MIN
_LAST = N_BUCKETS - 1
# frexp() mantissa bounds of the quarter octaves: 2^(k/4) / 2 for k = 1, 2, 3.
_Q1, _Q2, _Q3 = 2**0.25 / 2, 2**0.5 / 2, 2**0.75 / 2
# The value a bucket stands for: its geometric middle.
_BUCKET_VALUE: list[float] = (
    [LATENCY_MIN]
    + [LATENCY_MIN * 2.0 ** ((i - 0.5) / _PER_OCTAVE) for i in range(1, _LAST)]
    + [LATENCY_MIN * 2.0**_OCTAVES]
)


def latency_bucket(latency_s: float) -> int:
    """The histogram bucket of a latency in seconds."""
    if latency_s < LATENCY_MIN:
        return 0
    # frexp instead of log: the octave is the exponent, the quarter three
    # comparisons on the mantissa (5x cheaper than math.log here).
    mantissa, exponent = math.frexp(latency_s * _INV_MIN)
    if mantissa < _Q2:
        i = (exponent - 1) * _PER_OCTAVE + (1 if mantissa < _Q1 else 2)
    else:
        i = (exponent - 1) * _PER_OCTAVE + (3 if mantissa < _Q3 else 4)
    return i if i < _LAST else _LAST


def _bucket_floors_ns() -> list[int]:
    """For buckets 1.., the least latency in ns that ``latency_bucket`` puts
    there when given whole microseconds (``(ns // 1000) / 1e6``), found by
    bisection on the function itself: a bisect into this list is the bucket."""
    floors = []
    for bucket in range(1, _LAST + 1):
        low, high = 0, 1 << 50  # µs; far above the last bucket's floor
        while low < high:
            mid = (low + high) // 2
            if latency_bucket(mid / 1e6) >= bucket:
                high = mid
            else:
                low = mid + 1
        floors.append(low * 1000)
    return floors


_BUCKET_FLOOR_NS = _bucket_floors_ns()
# Every bucket's lower bound, as histogram.add_ns takes them.
_BUCKET_LOWER_NS = [0, *_BUCKET_FLOOR_NS, 1 << 80]
_BUCKETS = BucketBounds(_BUCKET_LOWER_NS)


@dataclass(frozen=True, slots=True)
class Signal:
    """An active anomaly. ``value`` and ``threshold`` are in the rule's unit
    (seconds for latency and waits, a 0..1 share for rates and saturation);
    ``since`` is on the monitor's clock, when the condition started holding."""

    name: str
    severity: str
    value: float
    threshold: float
    since: float
    message: str


class HealthMonitor:
    """Rolling health of one database: windows, a baseline, anomaly signals.

    ``now`` is a monotonic clock in seconds, injectable for tests.
    """

    def __init__(
        self,
        config: HealthConfig | None = None,
        *,
        name: str = "",
        now: Callable[[], float] = time.monotonic,
        shared: bool = False,
    ) -> None:
        cfg = config if config is not None else HealthConfig()
        self.config = cfg
        self.name = name
        self._now = now
        self._window = cfg.window_seconds
        # Ring of one-second slots (slot = second % slots): the window's whole
        # seconds plus the current, partial one, which evaluate() leaves out.
        w = self._slots = self._window + 1
        self._count = [0] * w
        self._errors = [0] * w
        self._hist = [0] * (w * N_BUCKETS)
        self._wait_n = [0] * w
        self._wait_sum = [0.0] * w
        self._wait_max = [0.0] * w
        self._zeros = [0] * N_BUCKETS
        self._sec = int(now())
        self._slot = self._sec % w
        # shared: second -> [queries, errors, {bucket: count}] observed here
        # and not yet handed to the other workers.
        self._unshared: dict[int, list[Any]] | None = {} if shared else None

        # Pool gauges, as last reported.
        self.saturation = 0.0
        self.waiting = 0
        self.oldest_wait = 0.0

        # Baseline (EWMA of windows that had min_samples).
        self.baseline_p50: float | None = None
        self.baseline_p99: float | None = None
        self.baseline_error_rate: float | None = None
        self._baseline_updates = 0
        self._last_eval: float | None = None

        # The last evaluation.
        self.window_stats: dict[str, Any] = {}
        self.signals: list[Signal] = []
        self._since: dict[str, float | None] = dict.fromkeys(
            (LATENCY_SPIKE, ERROR_RATE, SATURATION, STARVATION)
        )

    # ------------------------------------------------------------------ #
    # Feeding (hot path: O(1), no allocation beyond ints and floats)
    # ------------------------------------------------------------------ #

    def observe_query(
        self, latency_s: float, is_error: bool = False, now: float | None = None
    ) -> None:
        """One completed query (or transaction). ``is_error``: a server-sickness error.

        ``now``: the caller's own reading of the monitor's clock (it just took one
        to measure the latency), which saves a second clock call.
        """
        sec = int(self._now() if now is None else now)
        if sec != self._sec:
            self._roll(sec)
        slot = self._slot
        self._count[slot] += 1
        if is_error:
            self._errors[slot] += 1
            if self._unshared is not None:
                self._note_unshared(sec, 1, 1, {})
            return
        bucket = latency_bucket(latency_s)
        self._hist[slot * N_BUCKETS + bucket] += 1
        if self._unshared is not None:
            self._note_unshared(sec, 1, 0, {bucket: 1})

    def observe_latencies(
        self, latencies_ns: Sequence[int], errors: int = 0, now: float | None = None
    ) -> None:
        """Many completed queries at once (the drain's batches): ``latencies_ns``
        of those that did not end in a server-sickness error, and ``errors``
        that did. Counts exactly what ``observe_query((ns // 1000) / 1e6)``
        would for each."""
        sec = int(self._now() if now is None else now)
        if sec != self._sec:
            self._roll(sec)
        slot = self._slot
        self._count[slot] += len(latencies_ns) + errors
        self._errors[slot] += errors
        buckets: dict[int, int] = {}
        if latencies_ns:
            add_ns(buckets, latencies_ns, _BUCKETS)  # in any order: nothing is sorted
            hist, base = self._hist, slot * N_BUCKETS
            for bucket, count in buckets.items():
                hist[base + bucket] += count
        if self._unshared is not None:
            self._note_unshared(sec, len(latencies_ns) + errors, errors, buckets)

    def observe_pool(
        self, wait_s: float, saturation: float, waiting: int, now: float | None = None
    ) -> None:
        """A client got a server after ``wait_s``; ``saturation`` = active/size now."""
        sec = int(self._now() if now is None else now)
        if sec != self._sec:
            self._roll(sec)
        slot = self._slot
        self._wait_n[slot] += 1
        self._wait_sum[slot] += wait_s
        if wait_s > self._wait_max[slot]:
            self._wait_max[slot] = wait_s
        self.saturation = saturation
        self.waiting = waiting

    def observe_pool_state(self, saturation: float, waiting: int, oldest_wait_s: float) -> None:
        """The pool right now (from the 1 s tick): seen even when no acquisition completes."""
        self.saturation = saturation
        self.waiting = waiting
        self.oldest_wait = oldest_wait_s

    # ------------------------------------------------------------------ #
    # Workers: sharing the query windows
    # ------------------------------------------------------------------ #

    def _note_unshared(self, sec: int, count: int, errors: int, buckets: dict[int, int]) -> None:
        assert self._unshared is not None
        entry = self._unshared.get(sec)
        if entry is None:
            entry = self._unshared[sec] = [0, 0, {}]
        entry[0] += count
        entry[1] += errors
        seen = entry[2]
        for bucket, n in buckets.items():
            seen[bucket] = seen.get(bucket, 0) + n

    def take_unshared(self, before: int) -> list[list[Any]]:
        """What this worker observed in the whole seconds before ``before``
        and has not handed out yet: ``[second, queries, errors, {bucket:
        count}]`` each (for scry.peering to send to the other workers)."""
        if not self._unshared:
            return []
        done = [sec for sec in self._unshared if sec < before]
        return [[sec, *self._unshared.pop(sec)] for sec in sorted(done)]

    def merge(self, sec: int, count: int, errors: int, buckets: dict[int, int]) -> None:
        """Another worker's observations of second ``sec``: counted as if made here.
        A second older than the window, or not come yet here, is ignored."""
        if sec > self._sec:
            if sec > self._now():
                return
            self._roll(sec)
        if self._sec - sec > self._window:
            return
        slot = sec % self._slots
        self._count[slot] += count
        self._errors[slot] += errors
        base = slot * N_BUCKETS
        for bucket, n in buckets.items():
            if 0 <= bucket < N_BUCKETS:
                self._hist[base + bucket] += n

    def _roll(self, sec: int) -> None:
        gap = sec - self._sec
        if gap <= 0:
            return  # a clock that stepped back: keep writing into the current slot
        w = self._slots
        for k in range(1, min(gap, w) + 1):
            slot = (self._sec + k) % w
            self._count[slot] = 0
            self._errors[slot] = 0
            self._wait_n[slot] = 0
            self._wait_sum[slot] = 0.0
            self._wait_max[slot] = 0.0
            self._hist[slot * N_BUCKETS : (slot + 1) * N_BUCKETS] = self._zeros
        self._sec = sec
        self._slot = sec % w

    # ------------------------------------------------------------------ #
    # Evaluation (once per second)
    # ------------------------------------------------------------------ #

    def evaluate(self) -> list[Signal]:
        """Sum the window, apply the rules, update the baseline; the active signals."""
        cfg = self.config
        now = self._now()
        self._roll(int(now))
        stats = self._window_stats()
        self.window_stats = stats
        n, errors = stats["queries"], stats["errors"]
        ok = n - errors
        p50, p99 = stats["p50"], stats["p99"]
        rate = stats["error_rate"]
        ready = self._baseline_updates >= self._window
        signals: list[Signal] = []

        # Latency spike, against the baseline before this window joins it.
        base = self.baseline_p99
        if ready and base is not None and ok >= cfg.min_samples:
            threshold = max(cfg.latency_spike_factor * base, cfg.latency_floor_ms / 1000)
            firing = p99 > threshold
        else:
            threshold, firing = 0.0, False
        since = self._hold(LATENCY_SPIKE, firing, now)
        if since is not None:
            signals.append(
                Signal(
                    LATENCY_SPIKE,
                    self._severity(since, now),
                    p99,
                    threshold,
                    since,
                    f"p99 latency {p99 * 1000:.0f} ms over the last {self._window} s is "
                    f"{p99 / base if base else math.inf:.1f}x the baseline "
                    f"{(base or 0) * 1000:.0f} ms",
                )
            )

        # Error-rate anomaly; before a baseline exists the floor alone decides.
        base_rate = self.baseline_error_rate if ready else None
        threshold = max(cfg.error_rate_floor, cfg.error_rate_factor * (base_rate or 0.0))
        since = self._hold(ERROR_RATE, n >= cfg.min_samples and rate > threshold, now)
        if since is not None:
            signals.append(
                Signal(
                    ERROR_RATE,
                    self._severity(since, now),
                    rate,
                    threshold,
                    since,
                    f"{rate:.0%} of {n} queries failed with server errors over the last "
                    f"{self._window} s (threshold {threshold:.0%})",
                )
            )

        # Saturation: only reported once it has lasted.
        firing = self.saturation >= cfg.saturation_threshold and self.waiting > 0
        since = self._hold(SATURATION, firing, now)
        if since is not None and now - since >= cfg.sustain_seconds:
            signals.append(
                Signal(
                    SATURATION,
                    WARNING,
                    self.saturation,
                    cfg.saturation_threshold,
                    since,
                    f"pool {self.saturation:.0%} busy with {self.waiting} clients waiting "
                    f"for {now - since:.0f} s",
                )
            )

        # Starvation: the longest wait, finished in the window or still going.
        longest = max(stats["wait_max"], self.oldest_wait)
        since = self._hold(STARVATION, longest > cfg.starvation_seconds, now)
        if since is not None:
            signals.append(
                Signal(
                    STARVATION,
                    CRITICAL,
                    longest,
                    cfg.starvation_seconds,
                    since,
                    f"a client waited {longest:.1f} s for a server "
                    f"(threshold {cfg.starvation_seconds:g} s)",
                )
            )

        self._update_baseline(now, n, ok, p50, p99, rate)
        self.signals = signals
        return signals

    def should_open(self) -> str | None:
        """With ``health.predictive``, why the breaker should open now (else None).

        A latency spike or error-rate anomaly held for ``sustain_seconds``, as of
        the last :meth:`evaluate`.
        """
        if not self.config.predictive:
            return None
        for signal in self.signals:
            if signal.name in _PREDICTIVE_RULES and signal.severity == CRITICAL:
                return f"predictive: {signal.message}"
        return None

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the admin API, as of the last :meth:`evaluate`."""
        now = self._now()
        return {
            "name": self.name,
            "window_seconds": self._window,
            "window": dict(self.window_stats),
            "pool": {
                "saturation": self.saturation,
                "waiting": self.waiting,
                "oldest_wait_seconds": self.oldest_wait,
            },
            "baseline": {
                "p50": self.baseline_p50,
                "p99": self.baseline_p99,
                "error_rate": self.baseline_error_rate,
                "ready": self._baseline_updates >= self._window,
            },
            "signals": [
                {
                    "name": s.name,
                    "severity": s.severity,
                    "value": s.value,
                    "threshold": s.threshold,
                    "for_seconds": round(now - s.since, 3),
                    "message": s.message,
                }
                for s in self.signals
            ],
        }

    # ------------------------------------------------------------------ #

    def _window_stats(self) -> dict[str, Any]:
        """Totals over the last ``window_seconds`` whole seconds."""
        current = self._slot
        n = errors = waits = 0
        wait_sum = wait_max = 0.0
        merged = [0] * N_BUCKETS
        hist = self._hist
        for slot in range(self._slots):
            if slot == current:
                continue
            n += self._count[slot]
            errors += self._errors[slot]
            waits += self._wait_n[slot]
            wait_sum += self._wait_sum[slot]
            wait_max = max(wait_max, self._wait_max[slot])
            if self._count[slot]:
                base = slot * N_BUCKETS
                for b in range(N_BUCKETS):
                    merged[b] += hist[base + b]
        ok = n - errors
        return {
            "queries": n,
            "errors": errors,
            "qps": n / self._window,
            "error_rate": errors / n if n else 0.0,
            "p50": _percentile(merged, ok, 0.50),
            "p99": _percentile(merged, ok, 0.99),
            "wait_mean": wait_sum / waits if waits else 0.0,
            "wait_max": wait_max,
        }

    def _update_baseline(
        self, now: float, n: int, ok: int, p50: float, p99: float, rate: float
    ) -> None:
        # Time since the last evaluation (not since the last update), so idle
        # periods and open breakers do not count as "time to adapt".
        dt = 1.0 if self._last_eval is None else min(now - self._last_eval, self._window)
        self._last_eval = now
        if n < self.config.min_samples or dt <= 0:
            return
        alpha = 1.0 - 2.0 ** (-dt / self.config.baseline_half_life_seconds)
        self.baseline_error_rate = _ewma(self.baseline_error_rate, rate, alpha)
        if ok >= self.config.min_samples:
            self.baseline_p50 = _ewma(self.baseline_p50, p50, alpha)
            self.baseline_p99 = _ewma(self.baseline_p99, p99, alpha)
        self._baseline_updates += 1

    def _hold(self, rule: str, firing: bool, now: float) -> float | None:
        """Track since when ``rule`` has been firing; None when it is not."""
        if not firing:
            self._since[rule] = None
            return None
        since = self._since[rule]
        if since is None:
            since = self._since[rule] = now
        return since

    def _severity(self, since: float, now: float) -> str:
        return CRITICAL if now - since >= self.config.sustain_seconds else WARNING


def _ewma(previous: float | None, value: float, alpha: float) -> float:
    return value if previous is None else previous + alpha * (value - previous)


def _percentile(hist: list[int], total: int, q: float) -> float:
    """The value of the bucket holding the ``q`` quantile of ``total`` samples (0 if none)."""
    if total <= 0:
        return 0.0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for b, count in enumerate(hist):
        seen += count
        if seen >= rank:
            return _BUCKET_VALUE[b]
    return _BUCKET_VALUE[-1]
