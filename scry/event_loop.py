"""The event loop scry runs on: uvloop, less one cost per connection.

uvloop keeps each transport in a ``weakref.WeakValueDictionary`` keyed by its
file descriptor, only so that ``add_reader`` and friends can refuse a
descriptor a live transport owns. Storing a transport there runs four
Python frames (``__setitem__``, ``KeyedRef.__new__`` and ``__init__``) and a
fifth, the removal callback, when the transport goes: under ``pgbench -C``
about 2% of the proxy's CPU (perf and py-spy, docs/benchmarks.md, session
37). uvloop takes that class from the weakref module once, when it is first
imported, so :func:`run` imports it with :class:`FdRegistry` in its place,
which gives the same answers with one frame and no callback. The stdlib
modules uvloop imports are imported before the swap, so nothing else can
pick up the substitute; if uvloop was imported before, it keeps its own.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class FdRegistry:
    """File descriptor -> the live object last stored for it, held weakly.

    A dead entry answers as absent and stays until its descriptor is stored
    again (the kernel reuses the lowest free number), so the registry never
    holds more entries than the process ever had descriptors open at once.
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[Any]] = {}

    def __setitem__(self, fd: int, value: Any) -> None:
        self._refs[fd] = weakref.ref(value)

    def __getitem__(self, fd: int) -> Any:
        value = self._refs[fd]()
        if value is None:
            raise KeyError(fd)
        return value

    def __delitem__(self, fd: int) -> None:
        self[fd]  # noqa: B018 - KeyError for a dead entry too, as a WeakValueDictionary
        del self._refs[fd]

    def get(self, fd: int, default: Any = None) -> Any:
        ref = self._refs.get(fd)
        value = None if ref is None else ref()
        return default if value is None else value

    def __contains__(self, fd: object) -> bool:
        ref = self._refs.get(fd)  # type: ignore[call-overload]
        return ref is not None and ref() is not None

    def __iter__(self) -> Iterator[int]:
        return iter([fd for fd, ref in self._refs.items() if ref() is not None])

    def __len__(self) -> int:
        return sum(1 for ref in self._refs.values() if ref() is not None)


def _import_uvloop() -> Any:
    if "uvloop" in sys.modules:
        return sys.modules["uvloop"]
    # What uvloop imports, first: none of these may see the substitute.
    import concurrent.futures.thread  # noqa: F401
    import ssl  # noqa: F401
    import subprocess  # noqa: F401

    standard = weakref.WeakValueDictionary
    weakref.WeakValueDictionary = FdRegistry  # type: ignore[misc, assignment]
    try:
        import uvloop
    finally:
        weakref.WeakValueDictionary = standard  # type: ignore[misc]
    return uvloop


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a new uvloop loop (asyncio's own when uvloop is missing)."""
    try:
        uvloop = _import_uvloop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(main)
    return uvloop.run(main)  # type: ignore[no-any-return]
