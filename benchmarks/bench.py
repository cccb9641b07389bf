#!/usr/bin/env python3
"""Compare scry with PgBouncer and direct PostgreSQL using pgbench, in one run.

Everything runs on loopback in throwaway directories:

* a PostgreSQL cluster (:class:`scry.devcluster.DevCluster`, TLS off, tuned for
  benchmarking) initialised with ``pgbench -i -s SCALE``;
* PgBouncer (Debian's ``pgbouncer`` package), transaction pooling, pool size N;
* scry (``scry serve``), transaction pooling by default, same pool size, plus any
  number of scry *variants* with their own configuration overrides;
* optionally (``--targets ...,floor``) benchmarks/floor_pooler.py, a bare asyncio +
  uvloop transaction pooler: the floor for a Python pooler on this machine.

Runs are interleaved: each round runs every scenario against every target back
to back (target order rotated per round), and the tables report the median over
rounds. Besides pgbench's tps and latency, the CPU time (user+sys) consumed
during each run is measured for the proxy process tree, the PostgreSQL server,
pgbench itself and the whole machine, and reported per transaction.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench.py                    # defaults: 3 rounds, -T 10
    .venv/bin/python benchmarks/bench.py -T 5 --rounds 1    # quick check
    .venv/bin/python benchmarks/bench.py --targets pgbouncer,scry \\
        --variant scry-hybrid:pool.mode=hybrid \\
        --variant scry-noobs:observability.fingerprinting=false
    .venv/bin/python benchmarks/bench.py --scenarios S10,C50 --json results.json
    .venv/bin/python benchmarks/bench.py --targets direct,pgbouncer,scry,floor

See ``--help`` and benchmarks/README.md for every option.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import platform
import pwd
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scry.devcluster import DevCluster, find_pg_bindir  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
USER, PASSWORD, DBNAME = "app", "app_pass", "app"
PGBOUNCER_OS_USER = "postgres"
FLOOR_POOLER = Path(__file__).resolve().parent / "floor_pooler.py"
PGBOUNCER_INSTALL_HINT = (
    "PgBouncer not found (looked for /usr/sbin/pgbouncer and `pgbouncer` on PATH); "
    "skipping the 'pgbouncer' target. Install it with:  apt-get install -y pgbouncer"
)

#: postgresql.conf settings for benchmarking (on top of DevCluster's fsync=off etc.).
PG_BENCH_CONF: dict[str, str] = {
    "max_connections": "400",
    "shared_buffers": "256MB",  # pgbench scale 10 (~160 MB) fits in memory
    "autovacuum": "off",  # no background work between interleaved runs
    "jit": "off",
    "log_min_messages": "warning",
    "shared_preload_libraries": "''",  # pg_stat_statements off unless asked for
}

SCENARIO_KINDS = {
    "S": ("select-only, simple protocol", ["-S", "-M", "simple"]),
    "C": (
        "select-only, simple protocol, new connection per transaction",
        ["-S", "-M", "simple", "-C"],
    ),
    "E": ("select-only, extended protocol (unnamed statements)", ["-S", "-M", "extended"]),
    "W": ("TPC-B-like read/write, simple protocol", ["-M", "simple"]),
}


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float, alive: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGPASSWORD=PASSWORD, PGSSLMODE="disable", PGCONNECT_TIMEOUT="10", LC_ALL="C")
    return env


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_dotted(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{dotted}: {part} is not a mapping")
    node[last] = value


def version_of(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (
        (proc.stdout or proc.stderr).strip().splitlines()[0]
        if (proc.stdout or proc.stderr)
        else "?"
    )


def interpreter_of(script: str) -> str:
    """The Python a console script runs on, and its version: how that
    interpreter was built moves scry's CPU per connection by several percent
    (pyenv's default build against Debian's, docs/benchmarks.md, session 30)."""
    try:
        with open(script, "rb") as f:
            first = f.readline(512)
    except OSError:
        return "?"
    if not first.startswith(b"#!"):
        return "?"
    words = first[2:].decode(errors="replace").split()
    if words[:1] and os.path.basename(words[0]) == "env":
        words = [shutil.which(words[1]) or words[1]] if len(words) > 1 else []
    if not words:
        return "?"
    python = os.path.realpath(words[0])
    version = version_of([python, "-c", "import sys; print(sys.version.split()[0])"])
    return f"Python {version} ({python})"


# --------------------------------------------------------------------------- #
# CPU accounting from /proc
# --------------------------------------------------------------------------- #


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime+cutime+cstime in ticks) of a live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    # rest[0]=state [1]=ppid ... [11]=utime [12]=stime [13]=cutime [14]=cstime
    return int(rest[1]), int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])


def tree_cpu_ticks(root: int | None) -> int | None:
    """CPU ticks of a process and all its live descendants (threads included).

    Children that exited and were reaped inside the tree are counted through
    their parent's cutime/cstime, so deltas stay right across backend churn.
    """
    if root is None:
        return None
    ppids: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                ppids[int(entry)], ticks[int(entry)] = st
    if root not in ticks:
        return None
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total


def machine_ticks() -> tuple[int, int]:
    """(busy ticks, steal ticks) of all CPUs, from /proc/stat; busy includes
    steal (what "all µs" counts). Steal is time a vCPU was ready to run and
    the host ran something else: a noisy neighbour no target's CPU shows."""
    with open("/proc/stat") as f:
        return cpu_line_ticks(f.readline())


def cpu_line_ticks(line: str) -> tuple[int, int]:
    """(busy, steal) ticks of /proc/stat's ``cpu`` line."""
    fields = [int(x) for x in line.split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
    steal = fields[7] if len(fields) > 7 else 0
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + steal, steal


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #


class Target:
    kind = "?"

    def __init__(self, label: str) -> None:
        self.label = label
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.broken: str | None = None
        self.description = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def start(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def _spawn(self, cmd: list[str], *, workdir: Path, **kwargs: Any) -> None:
        self.log_path = workdir / f"{self.label}.out"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=True,  # Ctrl-C reaches us only; we stop it in order
                **kwargs,
            )
        if not wait_for_port(self.port, 20.0, self.alive):
            msg = f"{self.label} did not start listening on {HOST}:{self.port}"
            logs = [self.log_path, *getattr(self, "extra_logs", [])]
            self.stop()
            raise RuntimeError(msg + "".join(f"\n--- {p} ---\n{tail(p)}" for p in logs))


class DirectTarget(Target):
    kind = "direct"

    def __init__(self, label: str, pg_port: int) -> None:
        super().__init__(label)
        self.port = pg_port
        self.description = (
            f"PostgreSQL on {HOST}:{pg_port}, one backend per client (auth: scram-sha-256)"
        )

    def start(self) -> None:
        pass


class PgBouncerTarget(Target):
    kind = "pgbouncer"

    def __init__(
        self,
        label: str,
        binary: str,
        pg_port: int,
        pool_size: int,
        auth: str,
        workdir: Path,
        extra: list[str],
    ) -> None:
        super().__init__(label)
        self.binary, self.pg_port, self.pool_size, self.auth = binary, pg_port, pool_size, auth
        self.dir = workdir / label
        self.extra = extra
        self.extra_logs = [self.dir / "pgbouncer.log"]
        self.description = (
            f"{version_of([binary, '--version'])}, pool_mode=transaction, pool {pool_size}, "
            f"auth_type={auth}"
        )

    def start(self) -> None:
        self.dir.mkdir(mode=0o755, exist_ok=True)  # (again on --restart-every)
        self.port = free_port()
        ini = self.dir / "pgbouncer.ini"
        lines = [
            "[databases]",
            f"{DBNAME} = host={HOST} port={self.pg_port} dbname={DBNAME} "
            f"user={USER} password={PASSWORD}",
            "",
            "[pgbouncer]",
            f"listen_addr = {HOST}",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            f"auth_type = {self.auth}",
            f"auth_file = {self.dir / 'userlist.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            "min_pool_size = 0",
            "reserve_pool_size = 0",
            "max_client_conn = 1000",
            f"logfile = {self.dir / 'pgbouncer.log'}",
            f"pidfile = {self.dir / 'pgbouncer.pid'}",
            # scry runs with log.level=warning and logs no connections: same here.
            "log_connections = 0",
            "log_disconnections = 0",
            "ignore_startup_parameters = extra_float_digits",
            *self.extra,
        ]
        ini.write_text("\n".join(lines) + "\n")
        (self.dir / "userlist.txt").write_text(f'"{USER}" "{PASSWORD}"\n')
        kwargs: dict[str, Any] = {}
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            pw = pwd.getpwnam(PGBOUNCER_OS_USER)
            for path in (self.dir, ini, self.dir / "userlist.txt"):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            # user=/group= switch in the child before exec: the pid we get is
            # pgbouncer itself (no runuser/su wrapper in between).
            kwargs.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
            kwargs["env"] = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": pw.pw_dir,
                "USER": pw.pw_name,
                "LC_ALL": "C",
            }
        self._spawn([self.binary, str(ini)], workdir=self.dir, **kwargs)


class ScryTarget(Target):
    kind = "scry"

    def __init__(
        self,
        label: str,
        binary: str,
        base_config: dict[str, Any],
        overrides: dict[str, Any],
        workdir: Path,
    ) -> None:
        super().__init__(label)
        self.binary = binary
        self.config = deep_merge(base_config, overrides)
        self.overrides = overrides
        self.dir = workdir
        pool = self.config.get("pool", {})
        auth = self.config.get("auth") or {}
        self.description = (
            f"scry pool.mode={pool.get('mode')}, pool {pool.get('size')}, "
            f"auth.type={auth.get('type', 'scram-sha-256')}"
        ) + (f", overrides {json.dumps(overrides, separators=(',', ':'))}" if overrides else "")
        if Path(binary).parent != Path(sys.executable).parent:
            self.description += f", {binary}"
        self.description += f", on {interpreter_of(binary)}"

    def start(self) -> None:
        self.port = free_port()
        cfg = copy.deepcopy(self.config)
        cfg["listen_addr"] = f"{HOST}:{self.port}"
        admin = cfg.setdefault("admin", {})
        if isinstance(admin, dict) and "listen_addr" not in admin:
            admin["listen_addr"] = f"{HOST}:{free_port()}"  # never the shared default 6480
        path = self.dir / f"{self.label}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.config = cfg
        self._spawn([self.binary, "serve", "-c", str(path)], workdir=self.dir)


class FloorTarget(Target):
    """benchmarks/floor_pooler.py: the cheapest Python transaction pooler, as a yardstick."""

    kind = "floor"

    def __init__(self, label: str, pg_port: int, pool_size: int, workdir: Path) -> None:
        super().__init__(label)
        self.pg_port, self.pool_size, self.dir = pg_port, pool_size, workdir
        self.description = (
            f"{FLOOR_POOLER.name} (bare asyncio+uvloop transaction pooler, Python "
            f"{platform.python_version()}), pool {pool_size}, auth md5 (always)"
        )

    def start(self) -> None:
        self.port = free_port()
        self._spawn(
            [
                sys.executable, str(FLOOR_POOLER),
                "--listen-port", str(self.port),
                "--pg-host", HOST, "--pg-port", str(self.pg_port),
                "--user", USER, "--password", PASSWORD, "--dbname", DBNAME,
                "--pool-size", str(self.pool_size),
            ],
            workdir=self.dir,
        )  # fmt: skip


# --------------------------------------------------------------------------- #
# Scenarios and pgbench
# --------------------------------------------------------------------------- #


@dataclass
class Scenario:
    label: str
    description: str
    args: list[str]  # pgbench arguments except connection, -T and -j
    clients: int
    connect: bool  # -C: tps including connection time is the figure that matters


def parse_scenarios(spec: str, custom: list[str]) -> list[Scenario]:
    out: list[Scenario] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"([A-Za-z])(\d+)", item)
        if not m or m.group(1).upper() not in SCENARIO_KINDS:
            raise SystemExit(
                f"bad scenario {item!r}: expected KIND+CLIENTS with KIND one of "
                f"{', '.join(SCENARIO_KINDS)} (e.g. S10, C50)"
            )
        kind, clients = m.group(1).upper(), int(m.group(2))
        desc, args = SCENARIO_KINDS[kind]
        out.append(
            Scenario(
                f"{kind}{clients}",
                f"{desc}, {clients} clients",
                [*args, "-c", str(clients)],
                clients,
                kind == "C",
            )
        )
    for item in custom:
        label, sep, argstr = item.partition("=")
        if not sep or not label:
            raise SystemExit(f"bad --scenario {item!r}: expected LABEL=PGBENCH_ARGS")
        args = shlex.split(argstr)
        clients = 1
        for i, a in enumerate(args):
            if a == "-c" and i + 1 < len(args):
                clients = int(args[i + 1])
            elif a.startswith("-c") and a[2:].isdigit():
                clients = int(a[2:])
        out.append(Scenario(label, f"custom: pgbench {argstr}", args, clients, "-C" in args))
    if not out:
        raise SystemExit("no scenarios selected")
    return out


def parse_pgbench(output: str, connect: bool) -> dict[str, Any]:
    """Pull the figures out of pgbench's summary (PostgreSQL 12..17 formats)."""
    res: dict[str, Any] = {}
    tps_lines = re.findall(r"^tps = ([\d.]+) \(([^)]*)\)", output, re.M)
    with_conn = next((float(v) for v, note in tps_lines if "including" in note), None)
    without_conn = next(
        (float(v) for v, note in tps_lines if "without" in note or "excluding" in note), None
    )
    res["tps_including_connections"] = with_conn
    res["tps_excluding_connections"] = without_conn
    if connect:
        res["tps"] = with_conn if with_conn is not None else without_conn
    else:
        res["tps"] = without_conn if without_conn is not None else with_conn
    if res["tps"] is None and tps_lines:
        res["tps"] = float(tps_lines[0][0])

    def num(pattern: str, conv: Callable[[str], Any] = float) -> Any:
        m = re.search(pattern, output, re.M)
        return conv(m.group(1)) if m else None

    res["latency_ms"] = num(r"^latency average = ([\d.]+) ms")
    res["latency_stddev_ms"] = num(r"^latency stddev = ([\d.]+) ms")
    res["transactions"] = num(r"^number of transactions actually processed: (\d+)", int)
    res["failed"] = num(r"^number of failed transactions: (\d+)", int) or 0
    res["connection_ms"] = num(r"^(?:initial|average) connection time = ([\d.]+) ms")
    res["aborted_clients"] = len(re.findall(r"^client \d+ aborted", output, re.M))
    return res


@dataclass
class RunResult:
    round: int
    scenario: str
    target: str
    kind: str
    ok: bool
    tps: float | None = None
    latency_ms: float | None = None
    transactions: int | None = None
    failed: int = 0
    connection_ms: float | None = None
    tps_including_connections: float | None = None
    tps_excluding_connections: float | None = None
    proxy_cpu_us_per_txn: float | None = None
    pg_cpu_us_per_txn: float | None = None
    client_cpu_us_per_txn: float | None = None
    machine_cpu_us_per_txn: float | None = None
    proxy_cpu_pct: float | None = None
    other_cpu_pct: float | None = None  # machine CPU not used by proxy, PG or pgbench
    steal_pct: float | None = None  # host steal, % of one CPU (part of other_cpu_pct)
    elapsed_s: float = 0.0
    returncode: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, pg: DevCluster, pgbench: str) -> None:
        self.args, self.pg, self.pgbench = args, pg, pgbench
        self.pg_pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])

    def pgbench_cmd(self, target: Target, scenario_args: list[str], duration: int) -> list[str]:
        return [
            self.pgbench,
            "-h", HOST, "-p", str(target.port), "-U", USER,
            "-n",  # no VACUUM before the run (it fails through a pooler anyway)
            "-j", str(self.args.threads),
            "-T", str(duration),
            *self.args.pgbench_arg,
            *scenario_args,
            DBNAME,
        ]  # fmt: skip

    def run(self, target: Target, scenario: Scenario, rnd: int, duration: int) -> RunResult:
        res = RunResult(rnd, scenario.label, target.label, target.kind, ok=False)
        if not target.alive():
            res.error = f"{target.label} is not running"
            return res
        cmd = self.pgbench_cmd(target, scenario.args, duration)
        threads = min(self.args.threads, scenario.clients)
        cmd[cmd.index("-j") + 1] = str(threads)
        timeout = duration + self.args.run_timeout_slack
        p0, g0, (m0, s0), c0 = (
            tree_cpu_ticks(target.pid),
            tree_cpu_ticks(self.pg_pid),
            machine_ticks(),
            children_cpu_seconds(),
        )
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd,
                env=client_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                start_new_session=True,
            )
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = f"pgbench killed after {timeout}s"
            rc = None
        elapsed = time.monotonic() - t0
        p1, g1, (m1, s1), c1 = (
            tree_cpu_ticks(target.pid),
            tree_cpu_ticks(self.pg_pid),
            machine_ticks(),
            children_cpu_seconds(),
        )
        res.elapsed_s, res.returncode = round(elapsed, 3), rc
        parsed = parse_pgbench(out, scenario.connect)
        for key in (
            "tps",
            "latency_ms",
            "transactions",
            "failed",
            "connection_ms",
            "tps_including_connections",
            "tps_excluding_connections",
        ):
            setattr(res, key, parsed[key])
        res.extra["latency_stddev_ms"] = parsed["latency_stddev_ms"]
        res.extra["aborted_clients"] = parsed["aborted_clients"]
        txns = res.transactions or 0
        if txns > 0:
            us = 1e6 / CLK_TCK / txns
            if p0 is not None and p1 is not None:
                res.proxy_cpu_us_per_txn = round((p1 - p0) * us, 2)
                res.proxy_cpu_pct = round(100.0 * (p1 - p0) / CLK_TCK / elapsed, 1)
            if g0 is not None and g1 is not None:
                res.pg_cpu_us_per_txn = round((g1 - g0) * us, 2)
            res.machine_cpu_us_per_txn = round((m1 - m0) * us, 2)
            res.client_cpu_us_per_txn = round((c1 - c0) * 1e6 / txns, 2)
        ours = (p1 or 0) - (p0 or 0) + (g1 or 0) - (g0 or 0) + (c1 - c0) * CLK_TCK
        res.other_cpu_pct = round(max(0.0, 100.0 * ((m1 - m0) - ours) / CLK_TCK / elapsed), 1)
        res.steal_pct = round(100.0 * (s1 - s0) / CLK_TCK / elapsed, 1)
        problems = []
        if rc != 0:
            problems.append(f"pgbench exit {rc}")
        if res.tps is None:
            problems.append("no tps in pgbench output")
        if parsed["aborted_clients"]:
            problems.append(f"{parsed['aborted_clients']} clients aborted")
        if problems:
            lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
            res.error = "; ".join(problems) + (f": {' | '.join(lines[-3:])}" if lines else "")
        res.ok = res.tps is not None and rc == 0
        if not target.alive():
            target.broken = f"{target.label} exited during the run"
            res.error = (res.error + "; " if res.error else "") + target.broken
            res.ok = False
        return res


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``
    (order statistics, binomial coverage): ``(low, high, coverage)``, the
    narrowest symmetric one covering at least ``level``; None below 2 values.
    With few values it cannot reach ``level``: then the full range and the
    coverage it has (5 rounds: 94%; 12 rounds: x(3)..x(10), 96%)."""
    vals = sorted(values)
    n = len(vals)
    if n < 2:
        return None

    def coverage(k: int) -> float:  # of vals[k]..vals[n-1-k]: 1 - 2 P(Binomial(n, 1/2) <= k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n

    k = 0  # values dropped from each end
    while k + 1 < n - 2 - k and coverage(k + 1) >= level:
        k += 1
    return vals[k], vals[n - 1 - k], coverage(k)


def paired_ratios(
    results: list[RunResult], scenario: str, target: str, base: str, metric: str = "tps"
) -> list[float]:
    """``target``'s ``metric`` over ``base``'s, round by round (their runs
    are seconds apart, so drifting load on the machine cancels out)."""
    by_round: dict[tuple[str, int], float] = {}
    for r in results:
        value = getattr(r, metric)
        if r.scenario == scenario and r.ok and value:
            by_round[(r.target, r.round)] = value
    return [
        value / by_round[(base, rnd)]
        for (label, rnd), value in sorted(by_round.items(), key=lambda kv: kv[0][1])
        if label == target and (base, rnd) in by_round
    ]


def fmt_paired(ratios: list[float] | None) -> str:
    """``0.79× [0.74–0.83, 96%, 12 rounds]``: the median and its interval."""
    if not ratios:
        return "-"
    interval = median_interval(ratios)
    if interval is None:
        return f"{statistics.median(ratios):.2f}× [1 round]"
    low, high, coverage = interval
    return (
        f"{statistics.median(ratios):.2f}× [{low:.2f}–{high:.2f}, "
        f"{coverage:.0%}, {len(ratios)} rounds]"
    )


def summarize(
    results: list[RunResult],
    scenarios: list[Scenario],
    targets: list[Target],
    versus: str | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for sc in scenarios:
        per: dict[str, dict[str, Any]] = {}
        for t in targets:
            runs = [r for r in results if r.scenario == sc.label and r.target == t.label]
            good = [r for r in runs if r.ok]
            tps = [r.tps for r in good if r.tps is not None]
            per[t.label] = {
                "kind": t.kind,
                "runs": len(runs),
                "ok_runs": len(good),
                "tps": median(list(tps)),
                "tps_min": min(tps) if tps else None,
                "tps_max": max(tps) if tps else None,
                "latency_ms": median([r.latency_ms for r in good]),
                "connection_ms": median([r.connection_ms for r in good]),
                "failed": sum(r.failed for r in runs),
                "proxy_cpu_us_per_txn": median([r.proxy_cpu_us_per_txn for r in good]),
                "proxy_cpu_pct": median([r.proxy_cpu_pct for r in good]),
                "other_cpu_pct": median([r.other_cpu_pct for r in runs]),
                "other_cpu_pct_max": max(
                    (r.other_cpu_pct for r in runs if r.other_cpu_pct is not None), default=None
                ),
                "steal_pct": median([r.steal_pct for r in runs]),
                "steal_pct_max": max(
                    (r.steal_pct for r in runs if r.steal_pct is not None), default=None
                ),
                "pg_cpu_us_per_txn": median([r.pg_cpu_us_per_txn for r in good]),
                "client_cpu_us_per_txn": median([r.client_cpu_us_per_txn for r in good]),
                "machine_cpu_us_per_txn": median([r.machine_cpu_us_per_txn for r in good]),
                "errors": [r.error for r in runs if r.error],
            }
        ref_bouncer = next((v["tps"] for v in per.values() if v["kind"] == "pgbouncer"), None)
        ref_direct = next((v["tps"] for v in per.values() if v["kind"] == "direct"), None)
        ref_floor = next((v["tps"] for v in per.values() if v["kind"] == "floor"), None)
        for v in per.values():
            v["vs_pgbouncer"] = v["tps"] / ref_bouncer if v["tps"] and ref_bouncer else None
            v["vs_direct"] = v["tps"] / ref_direct if v["tps"] and ref_direct else None
            v["vs_floor"] = v["tps"] / ref_floor if v["tps"] and ref_floor else None
        # The ratio to PgBouncer within each round (their runs are seconds apart),
        # then the median of those: steadier than a ratio of medians when other
        # load on the machine drifts during a run.
        bouncer = next((t.label for t in targets if t.kind == "pgbouncer"), None)
        for label, v in per.items():
            ratios = paired_ratios(results, sc.label, label, bouncer) if bouncer else []
            v["vs_pgbouncer_rounds"] = ratios
            v["vs_pgbouncer_paired"] = median(list(ratios)) if ratios else None
        if versus is not None and versus in per:
            for label, v in per.items():
                v["vs_versus_tps"] = paired_ratios(results, sc.label, label, versus)
                v["vs_versus_cpu"] = paired_ratios(
                    results, sc.label, label, versus, "proxy_cpu_us_per_txn"
                )
        summary[sc.label] = per
    return summary


#: Table columns; "µs" columns are CPU microseconds per transaction.
COLUMNS = [
    ("target", "l"),
    ("tps", "r"),
    ("min–max", "r"),
    ("lat ms", "r"),
    ("conn ms", "r"),
    ("fail", "r"),
    ("proxy µs", "r"),
    ("proxy CPU", "r"),
    ("PG µs", "r"),
    ("pgbench µs", "r"),
    ("all µs", "r"),
    ("/PgBouncer", "r"),
    ("/direct", "r"),
]


def table_rows(per: dict[str, dict[str, Any]], connect: bool) -> list[list[str]]:
    rows = []
    for label, v in per.items():
        ok = f"{v['ok_runs']}/{v['runs']}"
        rows.append(
            [
                label + ("" if v["ok_runs"] == v["runs"] else f" ({ok} ok)"),
                fmt(v["tps"]),
                f"{fmt(v['tps_min'])}–{fmt(v['tps_max'])}" if v["tps_min"] is not None else "-",
                fmt(v["latency_ms"], ".3f"),
                fmt(v["connection_ms"], ".3f") if connect else "-",
                str(v["failed"]),
                fmt(v["proxy_cpu_us_per_txn"], ".1f"),
                fmt(v["proxy_cpu_pct"], ".0f", "%"),
                fmt(v["pg_cpu_us_per_txn"], ".1f"),
                fmt(v["client_cpu_us_per_txn"], ".1f"),
                fmt(v["machine_cpu_us_per_txn"], ".1f"),
                fmt(v["vs_pgbouncer"], ".2f", "×"),
                fmt(v["vs_direct"], ".2f", "×"),
            ]
        )
    return rows


def _plain_line(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if a == "l" else c.rjust(w)
        for c, w, (_, a) in zip(cells, widths, COLUMNS, strict=True)
    )


def print_report(
    summary: dict[str, dict[str, dict[str, Any]]],
    scenarios: list[Scenario],
    plain: bool,
    versus: str | None = None,
) -> None:
    console = None
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table

            console = Console(width=max(150, shutil.get_terminal_size().columns))
        except ImportError:
            console = None
    for sc in scenarios:
        per = summary[sc.label]
        title = f"{sc.label}: {sc.description} ({'tps incl. connections' if sc.connect else 'tps excl. connection time'})"
        rows = table_rows(per, sc.connect)
        if console is not None:
            table = Table(title=title, title_justify="left")
            for name, align in COLUMNS:
                table.add_column(name, justify="left" if align == "l" else "right", no_wrap=True)
            for row in rows:
                table.add_row(*row)
            console.print(table)
        else:
            widths = [
                max(len(name), *(len(r[i]) for r in rows)) for i, (name, _) in enumerate(COLUMNS)
            ]

            print(f"\n{title}")
            print(_plain_line([n for n, _ in COLUMNS], widths))
            print(_plain_line(["-" * w for w in widths], widths))
            for row in rows:
                print(_plain_line(row, widths))
        for label, v in per.items():
            for e in dict.fromkeys(v["errors"]):
                print(f"  ! {label}: {e}")
        other = [v["other_cpu_pct"] for v in per.values() if v["other_cpu_pct"] is not None]
        other_max = [v["other_cpu_pct_max"] for v in per.values() if v["other_cpu_pct_max"]]
        steal = [v["steal_pct"] for v in per.values() if v["steal_pct"] is not None]
        steal_max = [v["steal_pct_max"] for v in per.values() if v["steal_pct_max"]]
        if other:
            print(
                f"  other load on the machine during these runs: median "
                f"{statistics.median(other):.0f}% of a core, max {max(other_max, default=0):.0f}%"
                + (
                    f" (of which host steal: median {statistics.median(steal):.0f}%, "
                    f"max {max(steal_max, default=0):.0f}%)"
                    if steal
                    else ""
                )
            )
    print(
        "\nSummary (median tps; scry and floor targets / PgBouncer (and the median of the "
        "ratios within each round), / direct, scry / floor; proxy CPU µs per txn):"
    )
    for sc in scenarios:
        per = summary[sc.label]
        bouncer = next((b for b in per.values() if b["kind"] == "pgbouncer"), None)
        has_floor = any(v["kind"] == "floor" for v in per.values())
        lines = [
            f"  {sc.label:<6} {label:<14} {fmt(v['vs_pgbouncer'], '.2f', '×')} PgBouncer "
            f"(same-round {fmt_paired(v['vs_pgbouncer_rounds'])})  "
            f"{fmt(v['vs_direct'], '.2f', '×')} direct  "
            + (
                f"{fmt(v['vs_floor'], '.2f', '×')} floor  "
                if v["kind"] == "scry" and has_floor
                else ""
            )
            + f"(tps {fmt(v['tps'])}"
            + (f" vs {fmt(bouncer['tps'])}" if bouncer else "")
            + f"; CPU {fmt(v['proxy_cpu_us_per_txn'], '.1f')} µs"
            + (f" vs {fmt(bouncer['proxy_cpu_us_per_txn'], '.1f')}" if bouncer else "")
            + ")"
            for label, v in per.items()
            if v["kind"] in ("scry", "floor")
        ]
        print("\n".join(lines) if lines else f"  {sc.label:<6} (no scry or floor target)")
    if versus is not None:
        print(
            f"\nSame-round ratios to {versus} (median [interval for the median, its "
            "coverage, rounds]):"
        )
        for sc in scenarios:
            for label, v in summary[sc.label].items():
                if label != versus and "vs_versus_tps" in v:
                    print(
                        f"  {sc.label:<6} {label:<14} tps {fmt_paired(v['vs_versus_tps'])}  "
                        f"proxy CPU per txn {fmt_paired(v['vs_versus_cpu'])}"
                    )


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    label, _, rest = spec.partition(":")
    label = label.strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", label or ""):
        raise SystemExit(
            f"bad --variant {spec!r}: expected LABEL:key=value,... (LABEL [A-Za-z0-9_.-]+)"
        )
    overrides: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"bad --variant item {item!r}: expected dotted.key=value")
        set_dotted(overrides, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return label, overrides


def variant_binary(overrides: dict[str, Any], default: str) -> str:
    """A variant's ``bin=PATH`` (another scry executable, e.g. under another
    Python build) is not a config key: take it out of the overrides."""
    path = overrides.pop("bin", None)
    if path is None:
        return default
    if not os.access(str(path), os.X_OK):
        raise SystemExit(f"--variant bin={path}: not an executable")
    return str(path)


def find_pgbouncer(explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    if os.access("/usr/sbin/pgbouncer", os.X_OK):
        return "/usr/sbin/pgbouncer"
    return shutil.which("pgbouncer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "Scenario codes: "
            + "; ".join(f"{k}N = {d}" for k, (d, _) in SCENARIO_KINDS.items())
            + ". All use -j THREADS (default 1). Variants: LABEL:dotted.key=value,... merged "
            "into the scry config (values are YAML), e.g. "
            "scry-hybrid:pool.mode=hybrid or scry-noobs:observability.fingerprinting=false."
        ),
    )
    p.add_argument("-T", "--duration", type=int, default=10, help="seconds per pgbench run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument(
        "--scenarios", default="S1,S10,S50,C50", help="comma-separated scenario codes (see below)"
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="extra custom scenario: raw pgbench args (e.g. 'prep10=-S -M prepared -c 10'); repeatable",
    )
    p.add_argument("--threads", "-j", type=int, default=1, help="pgbench -j (capped at clients)")
    p.add_argument(
        "--pgbench-arg",
        action="append",
        default=[],
        help="extra pgbench argument for every run; repeatable",
    )
    p.add_argument(
        "--targets",
        default="direct,pgbouncer,scry",
        help="comma-separated: direct, pgbouncer, scry, floor (benchmarks/floor_pooler.py, "
        "a bare Python pooler; always md5) and any --variant labels",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VAL,...",
        help="an extra scry target with config overrides (bin=PATH: another scry "
        "executable, e.g. one installed under another Python); added to --targets if not "
        "listed; repeatable",
    )
    p.add_argument(
        "--pool-size",
        type=int,
        default=20,
        help="PgBouncer default_pool_size, scry pool.size and the floor's pool size",
    )
    p.add_argument(
        "--scry-mode",
        choices=["transaction", "hybrid", "session"],
        default="transaction",
        help="scry pool.mode",
    )
    p.add_argument(
        "--scry-config-extra",
        default=None,
        metavar="YAML",
        help="YAML mapping (or @file) deep-merged into every scry config, "
        "e.g. '{observability: {fingerprinting: false}}'",
    )
    p.add_argument(
        "--scry-bin", default=None, help="scry executable (default: next to this Python)"
    )
    p.add_argument("--pgbouncer-bin", default=None, help="pgbouncer executable")
    p.add_argument(
        "--pgbouncer-ini-extra",
        action="append",
        default=[],
        metavar="'KEY = VALUE'",
        help="extra line for pgbouncer.ini's [pgbouncer] section; repeatable",
    )
    p.add_argument(
        "--auth",
        choices=["md5", "scram-sha-256", "trust"],
        default="md5",
        help="client authentication at PgBouncer and scry (direct PostgreSQL always uses "
        "SCRAM); SCRAM's key derivation costs milliseconds per connection and dominates -C",
    )
    p.add_argument("--scale", "-s", type=int, default=10, help="pgbench -i scale factor")
    p.add_argument(
        "--pg-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra postgresql.conf setting",
    )
    p.add_argument(
        "--pg-stat-statements",
        action="store_true",
        help="preload pg_stat_statements in PostgreSQL (off by default)",
    )
    p.add_argument("--warmup", type=int, default=3, help="seconds of warm-up per target (0: none)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds of rest between runs")
    p.add_argument(
        "--restart-every",
        type=int,
        default=0,
        metavar="N",
        help="start every proxy afresh (and warm it up again) every N rounds, so that the "
        "same-round ratios span several processes of each target, not one (0: never)",
    )
    p.add_argument(
        "--run-timeout-slack", type=int, default=60, help="a run is killed after duration + this"
    )
    p.add_argument(
        "--versus",
        metavar="TARGET",
        help="also print every target's same-round tps and proxy-CPU ratios to TARGET, "
        "with an interval for their median (e.g. a variant with observability off; "
        "'--variant again:' adds a second, identical scry: an A/A check of the noise)",
    )
    p.add_argument("--json", metavar="FILE", help="write raw results and medians as JSON")
    p.add_argument(
        "--plain", action="store_true", help="plain-text tables even if rich is installed"
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="start PostgreSQL and the targets, print how to reach them, and wait for "
        "Ctrl-C or SIGTERM instead of running pgbench (for profilers: perf, py-spy, strace)",
    )
    return p


def warm_up(bench: Bench, targets: list[Target], seconds: int) -> None:
    """A short select-only run against each target, not counted."""
    if seconds <= 0:
        return
    scenario = Scenario("warmup", "warm-up", ["-S", "-M", "simple", "-c", "10"], 10, False)
    for t in targets:
        if t.broken is not None:
            continue
        r = bench.run(t, scenario, 0, seconds)
        if not r.ok:
            t.broken = f"warm-up failed: {r.error}"
            log(f"!! {t.label}: {t.broken}\n{tail(t.log_path) if t.log_path else ''}")
        else:
            log(f"  warm-up {t.label:<12} {fmt(r.tps)} tps")


def start_target(t: Target) -> bool:
    """Start ``t``; one that fails to start is marked broken (and said so),
    and the run goes on without it."""
    try:
        t.start()
    except RuntimeError as exc:
        t.broken = str(exc)
        log(f"!! {exc}")
        return False
    return True


def restart(targets: list[Target]) -> None:
    """--restart-every: each proxy stopped and started again, a new process."""
    for t in targets:
        if t.broken is not None or t.kind == "direct":
            continue
        t.stop()
        if start_target(t):
            log(f"  restarted {t.label:<12} {HOST}:{t.port}  pid {t.pid}")


def hold(targets: list[Target], pg_port: int) -> None:
    """--hold: keep everything running until interrupted (the caller cleans up)."""
    env = " ".join(f"{k}={v}" for k, v in client_env().items() if k.startswith("PG"))
    print(f"PostgreSQL {HOST}:{pg_port}, database {DBNAME}, user {USER} (password {PASSWORD})")
    for t in targets:
        if t.broken is None:
            print(
                f"{t.label}: pid {t.pid or '-'}: "
                f"{env} pgbench -h {HOST} -p {t.port} -U {USER} -S -M simple -c 10 -T 10 {DBNAME}"
            )
    print("holding; Ctrl-C or SIGTERM stops everything", flush=True)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration < 1 or args.rounds < 1:
        raise SystemExit("-T and --rounds must be at least 1")
    scenarios = parse_scenarios(args.scenarios, args.scenario)
    variants = dict(parse_variant(v) for v in args.variant)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    names += [v for v in variants if v not in names]
    builtin = ("direct", "pgbouncer", "scry", "floor")
    if reserved := sorted(set(variants) & {"direct", "pgbouncer", "floor"}):
        raise SystemExit(f"--variant label {reserved[0]!r} is reserved for a built-in target")
    for n in names:
        if n not in builtin and n not in variants:
            raise SystemExit(f"unknown target {n!r}: use {', '.join(builtin)} or a --variant label")
    if len(set(names)) != len(names):
        raise SystemExit("duplicate target names")
    if args.versus is not None and args.versus not in names:
        raise SystemExit(f"--versus {args.versus!r} is not one of the targets ({', '.join(names)})")

    extra_cfg: dict[str, Any] = {}
    if args.scry_config_extra:
        text = args.scry_config_extra
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        loaded = yaml.safe_load(text)
        if loaded is not None and not isinstance(loaded, dict):
            raise SystemExit("--scry-config-extra must be a YAML mapping")
        extra_cfg = loaded or {}

    pgbench = shutil.which("pgbench") or str(find_pg_bindir() / "pgbench")
    if not os.access(pgbench, os.X_OK):
        raise SystemExit("pgbench not found: install postgresql-contrib / postgresql-client")
    scry_bin = args.scry_bin or str(Path(sys.executable).parent / "scry")
    pgbouncer_bin = None
    if "pgbouncer" in names:
        pgbouncer_bin = find_pgbouncer(args.pgbouncer_bin)
        if pgbouncer_bin is None:
            log("!" * 78 + "\n" + PGBOUNCER_INSTALL_HINT + "\n" + "!" * 78)
            names.remove("pgbouncer")
    if any(n == "scry" or n in variants for n in names) and not os.access(scry_bin, os.X_OK):
        raise SystemExit(f"scry executable not found at {scry_bin}: `pip install -e .` in the venv")
    if not names:
        raise SystemExit("no targets left to benchmark")

    # SIGTERM/SIGHUP behave like Ctrl-C: unwind and clean up.
    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    # Ctrl-C even when started in the background by a shell that ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    results: list[RunResult] = []
    targets: list[Target] = []
    meta: dict[str, Any] = {}
    interrupted = False
    with contextlib.ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="scry-bench-"))
        stack.callback(shutil.rmtree, workdir, True)
        os.chmod(workdir, 0o755)

        pg_conf = dict(PG_BENCH_CONF)
        if args.pg_stat_statements:
            del pg_conf["shared_preload_libraries"]
        for item in args.pg_conf:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"bad --pg-conf {item!r}: expected KEY=VALUE")
            pg_conf[key.strip()] = value.strip()
        log(f"starting PostgreSQL ({find_pg_bindir()}) ...")
        pg = DevCluster(ssl=False, extra_conf=pg_conf, prefix="scry-bench-pg-")
        stack.callback(pg.stop)
        pg.start()
        log(f"pgbench -i -s {args.scale} on {HOST}:{pg.port} ...")
        init = subprocess.run(
            [
                pgbench,
                "-i",
                "-q",
                "-s",
                str(args.scale),
                "-h",
                HOST,
                "-p",
                str(pg.port),
                "-U",
                USER,
                DBNAME,
            ],
            env=client_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if init.returncode != 0:
            raise SystemExit(f"pgbench -i failed:\n{init.stdout}\n{init.stderr}")
        pg.psql("VACUUM ANALYZE; CHECKPOINT;", user="postgres", dbname=DBNAME)

        base_scry: dict[str, Any] = {
            "database_url": f"postgres://{USER}:{PASSWORD}@{HOST}:{pg.port}/{DBNAME}",
            "pool": {"mode": args.scry_mode, "size": args.pool_size},
            "auth": {"type": args.auth, "users": [{"name": USER, "password": PASSWORD}]},
            "log": {"level": "warning"},
        }
        base_scry = deep_merge(base_scry, extra_cfg)
        for n in names:
            if n == "direct":
                targets.append(DirectTarget(n, pg.port))
            elif n == "pgbouncer":
                assert pgbouncer_bin is not None
                targets.append(
                    PgBouncerTarget(
                        n,
                        pgbouncer_bin,
                        pg.port,
                        args.pool_size,
                        args.auth,
                        workdir,
                        args.pgbouncer_ini_extra,
                    )
                )
            elif n == "floor":
                targets.append(FloorTarget(n, pg.port, args.pool_size, workdir))
            else:
                overrides = dict(variants.get(n, {}))
                binary = variant_binary(overrides, scry_bin)
                targets.append(ScryTarget(n, binary, base_scry, overrides, workdir))
        for t in targets:
            stack.callback(t.stop)
            if start_target(t):
                log(f"  {t.label:<12} {HOST}:{t.port}  pid {t.pid or '-'}  {t.description}")
        if args.hold:
            hold(targets, pg.port)
            return 0
        bench = Bench(args, pg, pgbench)

        meta = {
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "python": sys.version.split()[0],
            "pgbench": version_of([pgbench, "--version"]),
            "postgres": version_of([str(pg.bindir / "postgres"), "--version"]),
            "pg_conf": pg_conf,
            "scry_git": version_of(["git", "-C", str(REPO), "describe", "--always", "--dirty"]),
            "targets": {
                t.label: {
                    "kind": t.kind,
                    "description": t.description,
                    "broken": t.broken,
                    **({"config": t.config} if isinstance(t, ScryTarget) else {}),
                }
                for t in targets
            },
            "scenarios": [asdict(s) for s in scenarios],
        }
        live = [t for t in targets if t.broken is None]
        restarts = (args.rounds - 1) // args.restart_every if args.restart_every > 0 else 0
        run_seconds = args.rounds * len(scenarios) * len(live) * (args.duration + args.pause)
        est = run_seconds + len(live) * args.warmup * (1 + restarts)
        log(
            f"{len(scenarios)} scenarios × {len(live)} targets × {args.rounds} rounds × {args.duration}s "
            f"≈ {est / 60:.1f} min (load average now {os.getloadavg()[0]:.2f})"
        )
        try:
            warm_up(bench, live, args.warmup)
            for rnd in range(1, args.rounds + 1):
                if args.restart_every > 0 and rnd > 1 and (rnd - 1) % args.restart_every == 0:
                    restart(live)
                    warm_up(bench, live, args.warmup)
                for sc in scenarios:
                    k = (rnd - 1) % len(targets)
                    for t in targets[k:] + targets[:k]:  # rotate order per round
                        if t.broken is not None:
                            continue
                        time.sleep(args.pause)
                        r = bench.run(t, sc, rnd, args.duration)
                        results.append(r)
                        log(
                            f"[{rnd}/{args.rounds}] {sc.label:<6} {t.label:<12} "
                            f"tps={fmt(r.tps):>7} lat={fmt(r.latency_ms, '.3f')}ms "
                            f"proxy={fmt(r.proxy_cpu_us_per_txn, '.1f')}µs/txn "
                            f"pg={fmt(r.pg_cpu_us_per_txn, '.1f')} machine={fmt(r.machine_cpu_us_per_txn, '.1f')}"
                            + (f"  !! {r.error}" if r.error else "")
                        )
                        if t.broken is not None and t.log_path is not None:
                            log(f"--- tail of {t.log_path} ---\n{tail(t.log_path)}")
        except KeyboardInterrupt:
            interrupted = True
            log("\ninterrupted: reporting what was measured, then cleaning up")

        summary = summarize(results, scenarios, targets, args.versus)
        print()
        print(
            f"pgbench {' '.join(args.pgbench_arg)} -j {args.threads} -T {args.duration}, "
            f"{args.rounds} rounds interleaved, pool size {args.pool_size}, scale {args.scale}; "
            f"{meta['postgres']}; {os.cpu_count()} CPUs"
        )
        for t in targets:
            print(
                f"  {t.label:<12} {t.description}"
                + (f"  [BROKEN: {t.broken.splitlines()[0]}]" if t.broken else "")
            )
        print_report(summary, scenarios, args.plain, args.versus)
        print(
            "\ntps: median over rounds (-C: including connection time); lat: pgbench's average "
            "latency; conn ms: average connection time (-C only).\n"
            "µs columns: CPU time (user+sys) consumed during the run per transaction -- proxy: "
            "its process tree; PG: postmaster and backends; pgbench: the client; all: every CPU "
            "of the machine, including anything else running and host steal. proxy CPU: % of one "
            "core."
        )
        if args.json:
            meta["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            meta["interrupted"] = interrupted
            Path(args.json).write_text(
                json.dumps(
                    {"meta": meta, "runs": [asdict(r) for r in results], "summary": summary},
                    indent=2,
                )
                + "\n"
            )
            print(f"raw results written to {args.json}")
    return 130 if interrupted else 0


def _entry() -> int:
    try:
        return main()
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(_entry())
