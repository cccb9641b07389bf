"""scry.log's syslog handler: lines go to a datagram socket; a missing one is
reported on the other handler, and logging goes on."""

from __future__ import annotations

import io
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from scry.log import Syslog, event, logger, setup_logging


@pytest.fixture
def restore_logger() -> Iterator[None]:
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    yield
    for handler in logger.handlers:
        if handler not in handlers:
            handler.close()
    logger.handlers[:], logger.propagate = handlers, propagate
    logger.setLevel(level)


def test_lines_go_to_syslog_with_ident_and_priority(tmp_path: Path, restore_logger) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(tmp_path / "log"))
        receiver.settimeout(5)
        stream = io.StringIO()
        setup_logging("info", stream=stream, syslog=Syslog("app", "local0", str(tmp_path / "log")))
        event("pool freed", logging.WARNING, pool="app/app")
        line = receiver.recv(4096)
    local0_warning = 16 * 8 + 4
    assert line.startswith(b"<%d>app[" % local0_warning), line
    assert line.rstrip(b"\0").endswith(b"]: warning pool freed pool=app/app"), line
    assert "warning pool freed pool=app/app" in stream.getvalue()  # stderr keeps its line


def test_an_unreachable_syslog_is_reported_and_logging_goes_on(
    tmp_path: Path, restore_logger, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, syslog=Syslog("app", "daemon", str(tmp_path / "none")))
    event("client login", client="c1")
    text = stream.getvalue()
    assert "syslog unreachable" in text and str(tmp_path / "none") in text
    assert "client login client=c1" in text
    assert "Traceback" not in capsys.readouterr().err  # (logging's own handleError prints one)
