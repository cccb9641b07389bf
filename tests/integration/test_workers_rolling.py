"""Rolling restart: a new instance takes over the port while the old one drains.

``scry serve --replace`` takes the listening sockets of the instance serving
the port (so connections waiting in their accept queues are not lost); the old
instance keeps serving its connected clients until they leave (PgBouncer's
SHUTDOWN WAIT_FOR_CLIENTS) and then exits. Under pgbench load, with and
without a new connection per transaction, no transaction fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import psycopg
import pytest

from scry.devcluster import find_pg_bindir, free_port

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_workers(proxy, workers: int, wait_until) -> None:
    wait_until(
        lambda: len(set(re.findall(r"listening .*worker=(\d+)", proxy.log_text()))) >= workers,
        15,
        what=f"{workers} workers listening",
    )


def start_replacing(proxy, old) -> None:
    """Start ``proxy`` (a ScryProcess not started yet) on ``old``'s port with --replace."""
    proxy.update_config({"listen_addr": f"127.0.0.1:{old.port}"})
    proxy.port = old.port
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "scry.cli", "serve", "-c", str(proxy.config_path), "--replace"]
    proxy.started_wall = time.time() - 0.5
    with open(proxy.log_path, "ab") as log:
        proxy.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def pgbench(proxy, tmp_path, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "select1.sql"
    script.write_text("select 1;\n")
    env = {**os.environ, "PGPASSWORD": "app_pass", "PGSSLMODE": "disable"}
    cmd = [
        str(find_pg_bindir() / "pgbench"),
        "-n", "-M", "simple", "-f", str(script),
        "-h", "127.0.0.1", "-p", str(proxy.port), "-U", "app",
        *args, "app",
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def assert_clean_run(bench: subprocess.Popen[str]) -> None:
    out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 0, out
    processed = re.search(r"number of transactions actually processed: (\d+)", out)
    assert processed and int(processed.group(1)) > 0, out
    failed = re.search(r"number of failed transactions: (\d+)", out)
    assert failed is None or int(failed.group(1)) == 0, out
    assert "aborted" not in out.lower(), out


@pytest.mark.parametrize("workers", [1, 2])
def test_rolling_restart_under_pgbench(scry_proxy, tmp_path, wait_until, workers) -> None:
    overrides = {"workers": workers, "pool": {"size": 8}}
    old = scry_proxy(overrides)
    if workers > 1:
        wait_workers(old, workers, wait_until)
    # Long enough that a new instance starting slowly on a loaded 2-core machine
    # still takes over while the load runs (checked below).
    steady = pgbench(old, tmp_path, "-c", "8", "-j", "2", "-T", "14")
    churn = pgbench(old, tmp_path, "-C", "-c", "4", "-j", "1", "-T", "14")
    time.sleep(2.5)
    new = scry_proxy(overrides, start=False)
    start_replacing(new, old)
    wait_until(
        lambda: new.log_text().count("took over listening sockets") >= workers,
        15,
        what="the takeover",
    )
    assert churn.poll() is None, "the takeover came after the load; nothing was tested"
    assert_clean_run(steady)
    assert_clean_run(churn)
    assert "client login" in new.log_text()  # new connections went to the new instance
    # The old instance left once its clients had gone; the new one serves.
    assert old.wait(15) == 0
    assert "handed over" in old.log_text()
    with psycopg.connect(**new.conninfo()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    assert new.returncode is None


def test_a_replacing_instance_stays_paused_with_the_breakers_held(scry_proxy, wait_until) -> None:
    """An operator's PAUSE and a breaker held open survive a rolling restart:
    the new instance takes them with the listening sockets, before it serves
    a client (not as its config says)."""
    admin_port = free_port()
    overrides = {
        "pool": {"size": 2},
        "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}", "token": "t"},
    }
    old = scry_proxy(overrides)
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{admin_port}/api/v1", headers={"Authorization": "Bearer t"}
    )
    with api:
        wait_until(lambda: _answers(api, "/status"), 10, what="the admin API")
        api.post("/breaker/trip", params={"database": "app"}).raise_for_status()
        api.post("/pause", params={"wait": 2}).raise_for_status()
        new = scry_proxy(overrides, start=False)
        start_replacing(new, old)
        wait_until(lambda: re.search(r" info listening ", new.log_text()), 15, what="it to listen")
        assert old.wait(15) == 0  # (no clients: it leaves at once)
        lines = new.log_text().splitlines()
        took = [i for i, line in enumerate(lines) if "took the replaced instance's state" in line]
        serving = [i for i, line in enumerate(lines) if " info listening " in line]
        assert took and took[0] < serving[0], lines
        assert "paused=['*'] breakers_held=['app']" in lines[took[0]]
        wait_until(lambda: _answers(api, "/status"), 10, what="the new admin API")
        assert api.get("/status").json()["paused"] is True
        (app,) = [d for d in api.get("/breaker").json()["databases"] if d["database"] == "app"]
        assert (app["breaker"]["state"], app["breaker"]["held"]) == ("open", True)
        api.post("/resume").raise_for_status()
        api.post("/breaker/reset", params={"database": "app"}).raise_for_status()
    with psycopg.connect(**new.conninfo()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_a_replacing_instance_with_more_workers_pauses_them_all(scry_proxy, wait_until) -> None:
    """Two new workers replace one: worker 1 takes no socket, and asks the
    old instance for its state instead (a client keeps the old one up)."""
    admin_port = free_port()
    admin = {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}", "token": "t"}
    old = scry_proxy({"pool": {"size": 2}, "admin": admin})
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{admin_port}/api/v1", headers={"Authorization": "Bearer t"}
    )
    with api, psycopg.connect(**old.conninfo(), autocommit=True) as stays:
        wait_until(lambda: _answers(api, "/status"), 10, what="the admin API")
        api.post("/pause", params={"wait": 2}).raise_for_status()
        new = scry_proxy({"pool": {"size": 2}, "admin": admin, "workers": 2}, start=False)
        start_replacing(new, old)
        took = "took the replaced instance's state paused=['*'] breakers_held=[] worker="
        wait_until(lambda: new.log_text().count(took) == 2, 15, what="both workers paused")
        assert f"{took}0" in new.log_text() and f"{took}1" in new.log_text()
        wait_until(lambda: _answers(api, "/status?worker=1"), 10, what="the new admin API")
        assert api.get("/status", params={"worker": 1}).json()["paused"] is True
        api.post("/resume").raise_for_status()
        stays.close()
        assert old.wait(15) == 0
    with psycopg.connect(**new.conninfo()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def _answers(api: httpx.Client, path: str) -> bool:
    try:
        return api.get(path).status_code == 200
    except httpx.TransportError:
        return False


def test_second_instance_without_replace_is_refused(scry_proxy, wait_until) -> None:
    old = scry_proxy({"workers": 2})
    wait_workers(old, 2, wait_until)
    new = scry_proxy({"workers": 2}, start=False)
    new.update_config({"listen_addr": f"127.0.0.1:{old.port}"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    cmd = [sys.executable, "-m", "scry.cli", "serve", "-c", str(new.config_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "start with --replace" in result.stderr
    with psycopg.connect(**old.conninfo()) as conn:  # the old one is unaffected
        assert conn.execute("select 1").fetchone() == (1,)
