"""The socket-free micro-benchmarks still run against today's proxy.

benchmarks/connectpath.py and hotpath.py drive the real ClientConnection and
ServerConnection with fake transports and assert on the way that each client
closed, the server went back to the pool and the client got the answer. So a
change to the relay that breaks them shows up here, not in the next
profiling session.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STEP = r"{} \d+\.\d"


def run_script(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCHMARKS.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize(
    ("flags", "steps", "absent"),
    [
        # 1,200 measured connections after 500 warm-up ones: drained at least twice.
        ((), ["made", "startup", "password", "query", "answer", "terminate", "lost", "drain"], []),
        (("--no-observe",), ["made", "lost", "drain"], []),
        (("--floor",), ["made", "startup", "password", "lost"], ["drain"]),  # nothing to drain
    ],
)
def test_connectpath_reports_every_step(
    flags: tuple[str, ...], steps: list[str], absent: list[str]
) -> None:
    out = run_script("connectpath.py", *flags, "1200")
    assert re.search(r"\d+\.\d us per connection \(1200", out), out
    for step in steps:
        assert re.search(STEP.format(step), out), (step, out)
    for step in absent:
        assert step not in out, (step, out)


@pytest.mark.parametrize("flags", [(), ("--no-observe",)])
def test_hotpath_reports_a_transaction(flags: tuple[str, ...]) -> None:
    out = run_script("hotpath.py", *flags, "3000")
    assert re.search(r"\d+\.\d us per transaction \(3000\)", out), out
    assert re.search(STEP.format("query"), out) and re.search(STEP.format("answer"), out), out


def test_hotpath_contended_hands_servers_over() -> None:
    out = run_script("hotpath.py", "--contended", "3000")
    assert re.search(r"us per transaction, contended \(50 clients, 20 servers, 3000", out), out
