"""Structured logging: one line per connection event, key=value (or JSON).

Never called per query on the hot path; the proxy logs logins, closes, pool
changes and errors only.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import socket
import sys
import time
from typing import NamedTuple

logger = logging.getLogger("scry")

#: syslog's facility names (``daemon``, ``local0`` ...), as PgBouncer's syslog_facility takes them.
SYSLOG_FACILITIES = logging.handlers.SysLogHandler.facility_names


class Syslog(NamedTuple):
    """Where log lines go besides stderr or the log file (PgBouncer's syslog)."""

    ident: str
    facility: str
    #: A Unix datagram socket's path, or ``host:port`` for UDP.
    address: str


class _KeyValueFormatter(logging.Formatter):
    timestamps = True

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        parts = [record.levelname.lower(), record.getMessage()]
        if self.timestamps:
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            parts.insert(0, f"{ts}.{int(record.msecs):03d}Z")
        parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        line = " ".join(parts)
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _SyslogFormatter(_KeyValueFormatter):
    timestamps = False  # (syslog stamps each line itself)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
            **(getattr(record, "fields", None) or {}),
        }
        return json.dumps(doc, default=str)


def _quote(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="'):
        return json.dumps(text)
    return text


def setup_logging(
    level: str = "info",
    fmt: str = "text",
    stream=None,
    path: str | None = None,
    syslog: Syslog | None = None,
) -> None:
    """Configure the ``scry`` logger (stderr by default; syslog as well)."""
    handler: logging.Handler
    handler = logging.FileHandler(path) if path else logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _KeyValueFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    use_syslog(syslog)


def use_syslog(syslog: Syslog | None) -> None:
    """Send the log lines to ``syslog`` as well (at start, and on a reload
    that changes it); None stops sending them."""
    for handler in [h for h in logger.handlers if isinstance(h, _SyslogHandler)]:
        logger.removeHandler(handler)
        handler.close()
    if syslog is not None:
        _add_syslog(syslog)


class _SyslogHandler(logging.handlers.SysLogHandler):
    """Drops a line syslog does not take (its daemon restarting, say), as
    C's syslog() does, instead of printing a traceback to stderr."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _add_syslog(syslog: Syslog) -> None:
    host, _, port = syslog.address.rpartition(":")
    address: str | tuple[str, int] = (
        (host, int(port)) if host and port.isdigit() else syslog.address
    )
    handler = _SyslogHandler(address, facility=SYSLOG_FACILITIES[syslog.facility])
    handler.ident = f"{syslog.ident}[{os.getpid()}]: "
    handler.setFormatter(_SyslogFormatter())
    logger.addHandler(handler)
    if isinstance(address, str):  # (the handler itself ignores a socket it cannot reach)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)
            except OSError as exc:
                event("syslog unreachable: its lines are dropped until it is",
                      logging.WARNING, address=address, error=exc.strerror or str(exc))  # fmt: skip


#: Logins and closes of clients and servers go through these children of
#: ``scry`` (same handler, same level), so that each kind can be turned off
#: alone: PgBouncer's log_connections and log_disconnections.
connections_logger = logging.getLogger("scry.connections")
disconnections_logger = logging.getLogger("scry.disconnections")


def log_connection_events(connections: bool, disconnections: bool) -> None:
    """Whether logins and closes are logged (``log.connections``, ``log.disconnections``)."""
    connections_logger.disabled = not connections
    disconnections_logger.disabled = not disconnections


def logging_connections() -> bool:
    """Whether logins are logged: check before computing costly fields (a syscall)."""
    return connections_logger.isEnabledFor(logging.INFO)


def logging_disconnections() -> bool:
    """Whether closes are logged."""
    return disconnections_logger.isEnabledFor(logging.INFO)


def event(msg: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one event with structured fields."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})


def connection_event(msg: str, **fields: object) -> None:
    """Log a login (of a client or a server), unless log.connections is off."""
    if connections_logger.isEnabledFor(logging.INFO):
        connections_logger.info(msg, extra={"fields": fields})


def disconnection_event(msg: str, **fields: object) -> None:
    """Log a close (of a client or a server), unless log.disconnections is off."""
    if disconnections_logger.isEnabledFor(logging.INFO):
        disconnections_logger.info(msg, extra={"fields": fields})
