"""benchmarks/bench.py end to end: --hold serves a profiler until SIGTERM and cleans
up; --restart-every measures on fresh processes."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """stdout up to the line holding ``marker`` (the bench's own start-up takes
    seconds). A thread reads, so that lines already in the pipe's text buffer
    are never left waiting behind a select() on the empty file descriptor."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        out.append(line)
        if marker in line:
            return "".join(out)
    raise AssertionError(f"no {marker!r} within {timeout}s; output:\n{''.join(out)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hold_serves_until_sigterm_then_cleans_up() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--targets", "scry", "--scale", "1", "--hold", "--plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = _read_until(proc, "holding;", timeout=120)
        found = re.search(r"^scry: pid (\d+): .* -p (\d+) ", out, re.M)
        assert found, out
        pid, port = int(found[1]), int(found[2])
        with psycopg.connect(
            host="127.0.0.1", port=port, user="app", password="app_pass", dbname="app"
        ) as conn:
            assert conn.execute("select count(*) from pgbench_branches").fetchone() == (1,)
        pg_port = int(re.search(r"^PostgreSQL 127\.0\.0\.1:(\d+),", out, re.M)[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:  # (a failed assertion) let the bench stop what it started
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert not _alive(pid)
    for stopped in (port, pg_port):  # scry and PostgreSQL both
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", stopped), timeout=2).close()


def test_restart_every_runs_each_round_on_a_new_process(tmp_path: Path) -> None:
    """--restart-every 1: round 2 is measured on another scry process than round 1."""
    out_json = tmp_path / "runs.json"
    done = subprocess.run(
        [
            sys.executable, str(BENCH), "--targets", "scry", "--scale", "1",
            "--scenarios", "S2", "--rounds", "2", "-T", "1", "--warmup", "1", "--pause", "0",
            "--restart-every", "1", "--plain", "--json", str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    started = re.search(r"^\s+scry\s+127\.0\.0\.1:\d+\s+pid (\d+)", done.stderr, re.M)
    restarted = re.findall(r"^\s+restarted scry\s+127\.0\.0\.1:\d+\s+pid (\d+)", done.stderr, re.M)
    assert started and len(restarted) == 1, done.stderr
    assert restarted[0] != started[1]
    assert not _alive(int(started[1]))
    warmups = re.findall(r"^\s+warm-up scry\s", done.stderr, re.M)
    assert len(warmups) == 2, done.stderr  # once at the start, once after the restart
    runs = json.loads(out_json.read_text())["runs"]
    assert [(r["round"], r["ok"]) for r in runs] == [(1, True), (2, True)]
