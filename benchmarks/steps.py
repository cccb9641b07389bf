"""Timing for the socket-free micro-benchmarks (hotpath.py, connectpath.py).

A :class:`Steps` times each protocol callback of a scripted exchange in thread
CPU time and reports the cost per named step. With ``cold_kib`` it first
overwrites that much memory before every step, evicting the CPU caches the
way a busy proxy's other connections, the kernel and PostgreSQL on the same
cores do between two callbacks of one connection. Warm figures show how much
work a step does; cold ones how much code and data it touches, which is what
dominates live (a pgbench -C connection costs scry ~4x its warm figure).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

# L2 here is 1 MiB per core and L3 32 MiB shared: 2 MiB evicts L1 and L2, 16 MiB most of L3.
DEFAULT_COLD_KIB = 16 * 1024


def cold_kib_from_argv(argv: list[str]) -> int:
    """``--cold`` (16 MiB) or ``--cold=KIB``; 0 for warm runs."""
    for arg in argv:
        if arg == "--cold":
            return int(os.environ.get("COLD_KIB", DEFAULT_COLD_KIB))
        if arg.startswith("--cold="):
            return int(arg.split("=", 1)[1])
    return 0


class CacheEvictor:
    """Called, writes ``cold_kib`` KiB of memory: one write per cache line."""

    def __init__(self, cold_kib: int) -> None:
        self._junk = bytearray(cold_kib << 10)
        self._zeros = bytes(len(self._junk) // 64)

    def __call__(self) -> None:
        self._junk[::64] = self._zeros


class Steps:
    def __init__(self, names: list[str], cold_kib: int = 0) -> None:
        self.names = names
        self.cold_kib = cold_kib
        self._evict = CacheEvictor(cold_kib) if cold_kib else None
        self.reset()

    def reset(self) -> None:
        self.ns = [0] * len(self.names)
        self.rounds = 0
        self._next = 0  # the step the next call is

    def run(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
        """The next steps of an exchange: each (callback, args) in order, one
        step each; a round ends with the last named step."""
        evict, ns, clock = self._evict, self.ns, time.thread_time_ns
        for call, args in calls:
            if evict is not None:
                evict()
            t = clock()
            call(*args)
            ns[self._next] += clock() - t
            self._next += 1
            if self._next == len(ns):
                self._next = 0
                self.rounds += 1

    def report(self, what: str) -> str:
        n = max(self.rounds, 1)
        parts = "  ".join(
            f"{name} {ns / n / 1e3:.1f}" for name, ns in zip(self.names, self.ns, strict=True)
        )
        cold = f", caches evicted ({self.cold_kib} KiB) before each step" if self.cold_kib else ""
        return f"{sum(self.ns) / n / 1e3:.1f} us per {what} ({self.rounds}{cold})\n  {parts}"
