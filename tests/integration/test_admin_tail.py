"""The live tail: ``GET /api/v1/tail`` (NDJSON and SSE, filters) and the
``scry tail`` command (``--json``, a closed pipe, a proxy restart)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from scry.devcluster import free_port

TOKEN = "t0k-tail"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CANARY = "canary-tail-5f3a"
SCRY = Path(sys.executable).with_name("scry")


def _wait_admin(base: str, proxy) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"admin API not up\n{proxy.log_tail()}")


@pytest.fixture
def tail_proxy(scry_proxy):
    port = free_port()
    proxy = scry_proxy(
        {"admin": {"enabled": True, "listen_addr": f"127.0.0.1:{port}", "token": TOKEN}}
    )
    base = f"http://127.0.0.1:{port}"
    _wait_admin(base, proxy)
    return proxy, base


@contextmanager
def workload(proxy, statements: list[str], interval: float = 0.05) -> Iterator[None]:
    """Run ``statements`` over and over in a thread (errors are expected and ignored)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
                    while not stop.is_set():
                        for sql in statements:
                            try:
                                conn.execute(sql)
                            except psycopg.errors.Error as exc:
                                if isinstance(exc, psycopg.OperationalError):
                                    raise
                        stop.wait(interval)
            except psycopg.OperationalError:
                stop.wait(0.2)  # the proxy is restarting

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def read_stream(base: str, params: dict[str, Any], want: int, sse: bool = False) -> list[str]:
    """The first ``want`` non-heartbeat lines (NDJSON) or data fields (SSE)."""
    headers = dict(AUTH, Accept="text/event-stream" if sse else "application/x-ndjson")
    out: list[str] = []
    deadline = time.monotonic() + 10
    with httpx.stream(
        "GET", f"{base}/api/v1/tail", params=params, headers=headers, timeout=5
    ) as response:
        assert response.status_code == 200
        kind = response.headers["content-type"]
        assert kind.startswith("text/event-stream" if sse else "application/x-ndjson")
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"only {len(out)} lines: {out}"
            if sse:
                if line.startswith("data: ") and '"heartbeat"' not in line:
                    out.append(line[len("data: ") :])
            elif line and '"heartbeat"' not in line:
                out.append(line)
            if len(out) >= want:
                break
    return out


def test_tail_streams_anonymized_events_with_filters(tail_proxy) -> None:
    proxy, base = tail_proxy
    statements = [
        f"select '{CANARY}' as c, 42",
        "select pg_sleep(0.03)",
        f"select * from no_such_table_{CANARY.replace('-', '_')}",
    ]
    with workload(proxy, statements):
        lines = read_stream(base, {}, 9)
        events = [json.loads(line) for line in lines]
        assert all(CANARY not in line for line in lines)
        queries = [e for e in events if e["type"] == "query"]
        assert {e["database"] for e in queries} == {"app"}
        texts = {e["query"] for e in queries}
        assert any("select $1 as c" in t.lower() for t in texts), texts
        assert all(
            set(e) >= {"ts", "client_id", "fingerprint", "total_us", "sqlstate", "pin_reasons"}
            for e in queries
        )

        errors = [json.loads(x) for x in read_stream(base, {"errors": "true"}, 3)]
        assert {e["sqlstate"] for e in errors} == {"42P01"}

        slow = [json.loads(x) for x in read_stream(base, {"min_ms": 25}, 3)]
        assert all(e["total_us"] >= 25_000 for e in slow)
        fingerprint = slow[0]["fingerprint"]
        same = [json.loads(x) for x in read_stream(base, {"fingerprint": fingerprint}, 2)]
        assert {e["fingerprint"] for e in same} == {fingerprint}

        sse = [json.loads(x) for x in read_stream(base, {}, 3, sse=True)]
        assert all(e["type"] == "query" and CANARY not in json.dumps(e) for e in sse)

    response = httpx.get(f"{base}/api/v1/tail", params={"min_ms": "x"}, headers=AUTH)
    assert response.status_code == 400 and response.json()["code"] == "bad_parameter"
    assert httpx.get(f"{base}/api/v1/tail").status_code == 401


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    env["SCRY_ADMIN_TOKEN"] = TOKEN
    return env


def test_scry_tail_json_and_restart(tail_proxy, tmp_path: Path) -> None:
    proxy, base = tail_proxy
    stderr_path = tmp_path / "tail.err"
    with workload(proxy, [f"select '{CANARY}'"]), open(stderr_path, "wb") as stderr:
        tail = subprocess.Popen(
            [str(SCRY), "tail", base.removeprefix("http://"), "--json"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=_env(),
        )
        try:
            assert tail.stdout is not None
            first = [json.loads(tail.stdout.readline()) for _ in range(3)]
            assert all(e["type"] == "query" and e["database"] == "app" for e in first)
            assert all(CANARY not in json.dumps(e) for e in first)

            # A restart of the proxy: the tail reconnects and goes on.
            proxy.stop()
            proxy.start()
            _wait_admin(base, proxy)
            deadline = time.monotonic() + 15
            while "reconnecting" not in stderr_path.read_text():
                assert time.monotonic() < deadline, stderr_path.read_text()
                time.sleep(0.1)
            later = json.loads(tail.stdout.readline())
            assert later["type"] == "query" and later["ts"] > first[-1]["ts"]
            assert tail.poll() is None
            tail.send_signal(signal.SIGINT)
            try:
                tail.communicate(timeout=10)  # (read on: a full pipe would block a print)
            except subprocess.TimeoutExpired:
                pytest.fail(f"scry tail ignored SIGINT; its stderr:\n{stderr_path.read_text()}")
            assert tail.returncode == 0
        finally:
            if tail.poll() is None:
                tail.kill()
                tail.wait(5)
    assert "Traceback" not in stderr_path.read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_scry_tail_stops_at_a_signal_while_reconnecting(tail_proxy, tmp_path: Path, sig) -> None:
    # The proxy is gone: the tail is between attempts (or in one); Ctrl-C or a
    # TERM ends it at once, with status 0.
    proxy, base = tail_proxy
    stderr_path = tmp_path / "tail.err"
    with workload(proxy, ["select 1"]), open(stderr_path, "wb") as stderr:
        tail = subprocess.Popen(
            [str(SCRY), "tail", base.removeprefix("http://"), "--json"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=_env(),
        )
        assert tail.stdout is not None
        json.loads(tail.stdout.readline())
    proxy.stop()
    deadline = time.monotonic() + 15
    while "reconnecting" not in stderr_path.read_text():
        assert time.monotonic() < deadline, stderr_path.read_text()
        time.sleep(0.1)
    tail.send_signal(sig)
    try:
        tail.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        tail.kill()
        pytest.fail(f"scry tail ignored the signal; its stderr:\n{stderr_path.read_text()}")
    assert tail.returncode == 0, stderr_path.read_text()
    assert "Traceback" not in stderr_path.read_text()


def test_scry_tail_into_head_exits_cleanly(tail_proxy) -> None:
    proxy, base = tail_proxy
    with workload(proxy, ["select 1"]):
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail; '{SCRY}' tail '{base}' | head -1"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=20,
        )
    assert done.returncode == 0, done.stderr
    assert "select" in done.stdout.lower() and len(done.stdout.splitlines()) == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr

    # With no event after the one head wanted, the closed pipe is noticed at a heartbeat.
    shell = subprocess.Popen(
        ["bash", "-c", f"set -o pipefail; '{SCRY}' tail '{base}' --json | head -1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        with workload(proxy, ["select 2"], interval=0.2):
            assert shell.stdout is not None
            assert json.loads(shell.stdout.readline())["type"] == "query"
        assert shell.wait(10) == 0, shell.stderr.read() if shell.stderr else ""
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait(5)


def test_scry_tail_unreachable_and_bad_token(tail_proxy) -> None:
    _, base = tail_proxy
    env = _env()
    env["SCRY_ADMIN_TOKEN"] = "wrong"
    done = subprocess.run([str(SCRY), "tail", base], capture_output=True, text=True, env=env, timeout=20)  # fmt: skip
    assert done.returncode == 1 and "wrong token" in done.stderr
    done = subprocess.run(
        [str(SCRY), "tail", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=20,
    )
    assert done.returncode == 1 and "cannot reach" in done.stderr


def test_a_reader_that_never_reads_costs_drops_not_latency(tail_proxy) -> None:
    """A tail whose reader stops reading gets its events dropped (counted);
    queries keep their pace and the admin API keeps answering."""
    proxy, base = tail_proxy
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    reader.sendall(
        f"GET /api/v1/tail HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    # ~4 KiB events: the socket buffers fill after a few hundred of them.
    wide = "select " + ", ".join(f"{i} as column_with_a_long_name_{i}" for i in range(120))
    try:
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
            started = time.monotonic()
            for _ in range(3000):  # one statement per round trip: one event each
                conn.execute(wide)
            elapsed = time.monotonic() - started
        deadline = time.monotonic() + 10
        while True:
            status = httpx.get(f"{base}/api/v1/status", headers=AUTH, timeout=5).json()
            if status["queries"]["tail_events_dropped"] > 0:
                break
            assert time.monotonic() < deadline, (elapsed, json.dumps(status["queries"]))
            time.sleep(0.2)
        assert elapsed < 20, elapsed
    finally:
        reader.close()
