"""``scry demo`` on a terminal opens the console; quitting it removes everything."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scry.devcluster import DevClusterError, find_pg_bindir

SCRY = Path(sys.executable).with_name("scry")
CLUSTER_LINE = re.compile(r"data dir (?P<datadir>\S+), pid (?P<pid>\d+)\)")


def _read_until(fd: int, buffer: bytearray, needle: bytes, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while needle not in buffer and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return needle in buffer
            if not chunk:
                break
            buffer.extend(chunk)
    return needle in buffer


def test_demo_opens_the_console_and_quitting_cleans_up() -> None:
    try:
        find_pg_bindir()
    except DevClusterError as exc:
        pytest.skip(str(exc))
    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRY_")}
    env.update(TERM="xterm-256color", COLUMNS="160", LINES="44", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [str(SCRY), "demo", "--port", "0", "--clients", "3"],
        stdin=child, stdout=child, stderr=child, env=env, close_fds=True, start_new_session=True,
    )  # fmt: skip
    os.close(child)
    out = bytearray()
    try:
        # The console's top bar, then the ranking filling with the workload's queries.
        assert _read_until(main, out, b"Top", 60), out.decode(errors="replace")[-3000:]
        assert _read_until(main, out, b"fingerprints", 30), out.decode(errors="replace")[-3000:]
        time.sleep(2)
        os.write(main, b"q")
        assert _read_until(main, out, b"stopped PostgreSQL", 60), out.decode(errors="replace")[-3000:]  # fmt: skip
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    text = out.decode(errors="replace")
    assert "Traceback" not in text
    match = CLUSTER_LINE.search(text)
    assert match, text[-3000:]
    assert not Path(match["datadir"]).exists()
    assert "ran " in text and " queries in " in text
