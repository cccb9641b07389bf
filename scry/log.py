"""Structured logging: one line per connection event, key=value (or JSON).

Never called per query on the hot path; the proxy logs logins, closes, pool
changes and errors only.
"""

from __future__ import annotations

import json
import logging
import sys
import time

logger = logging.getLogger("scry")


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = getattr(record, "fields", None) or {}
        parts = [f"{ts}.{int(record.msecs):03d}Z", record.levelname.lower(), record.getMessage()]
        parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        line = " ".join(parts)
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return line


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
    level: str = "info", fmt: str = "text", stream=None, path: str | None = None
) -> None:
    """Configure the ``scry`` logger (stderr by default)."""
    handler: logging.Handler
    handler = logging.FileHandler(path) if path else logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _KeyValueFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


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
