"""``scry demo`` end to end: a real subprocess, its own PostgreSQL, and cleanup.

The demo creates (and must remove) its own cluster, so these tests do not use
the session ``pg`` fixture. Each one parses the line the demo prints about its
cluster (``data dir ..., pid N``) to check that the postmaster is gone and the
temporary directory removed afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scry.devcluster import DevClusterError, find_pg_bindir, free_port

REPO = Path(__file__).resolve().parents[2]
SCRY = Path(sys.executable).with_name("scry")

CLUSTER_LINE = re.compile(r"data dir (?P<datadir>\S+), pid (?P<pid>\d+)\)")
RAN_LINE = re.compile(r"ran (?P<n>\d+) queries")


@pytest.fixture(autouse=True)
def _need_postgres() -> None:
    try:
        find_pg_bindir()
    except DevClusterError as exc:
        pytest.skip(str(exc))
    if not SCRY.exists():
        pytest.skip(f"console script not installed next to the interpreter: {SCRY}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours
        return True
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _assert_cleaned_up(output: str) -> None:
    match = CLUSTER_LINE.search(output)
    assert match, f"the demo did not report its cluster:\n{output}"
    datadir, pid = match["datadir"], int(match["pid"])
    deadline = time.monotonic() + 5
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(pid), f"postmaster {pid} still running"
    leftover = subprocess.run(["pgrep", "-f", datadir], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"processes still using {datadir}: {leftover}"
    assert not Path(datadir).exists()
    assert not Path(datadir).parent.exists(), f"{Path(datadir).parent} was not removed"


def _assert_ran_queries(output: str) -> int:
    match = RAN_LINE.search(output)
    assert match, f"no query count in the output:\n{output}"
    n = int(match["n"])
    assert n > 0
    return n


def test_demo_runs_for_duration_and_cleans_up() -> None:
    port = free_port()
    proc = subprocess.run(
        [str(SCRY), "demo", "--duration", "6", "--clients", "4", "--port", str(port)],
        cwd=REPO,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    assert f'psql "postgres://app:app_pass@127.0.0.1:{port}/app"' in output, output
    _assert_ran_queries(output)
    # The final frame of the status panel shows every query kind and the pool.
    for label in ("browse products", "order details", "session client", "app/app"):
        assert label in output, output
    _assert_cleaned_up(output)


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [str(SCRY), "demo", "--clients", "3", "--port", "0"],
        cwd=REPO,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    connected = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "connect with:" in line:
                connected.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        assert connected.wait(40), "".join(lines)
        time.sleep(2)  # let the workload run a little
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    thread.join(5)
    output = "".join(lines)
    assert "Traceback" not in output, output
    assert "(interrupted)" in output, output
    _assert_ran_queries(output)
    _assert_cleaned_up(output)
