"""A transport that keeps what it is given, for driving connections in-process."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from scry.pool import Pool


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.data += data

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 5432)


def msg(kind: bytes, body: bytes = b"") -> bytes:
    """One protocol message."""
    return kind + struct.pack("!i", len(body) + 4) + body


@contextmanager
def offline_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.AbstractEventLoop]:
    """A fresh event loop, current while in use, whose pools open no servers."""
    monkeypatch.setattr(Pool, "_spawn", lambda pool: None)  # no PostgreSQL here
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()
