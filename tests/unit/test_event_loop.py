"""scry.event_loop: uvloop with FdRegistry as its transport registry."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from scry.event_loop import FdRegistry


class Thing:
    pass


def test_registry_holds_weakly_and_answers_as_a_weak_value_dictionary() -> None:
    registry = FdRegistry()
    a, b = Thing(), Thing()
    registry[5] = a
    registry[6] = b
    assert registry[5] is a and registry.get(6) is b and 5 in registry
    assert sorted(registry) == [5, 6] and len(registry) == 2
    del b
    gc.collect()
    with pytest.raises(KeyError):
        registry[6]  # noqa: B018
    assert 6 not in registry and registry.get(6, "gone") == "gone" and list(registry) == [5]
    with pytest.raises(KeyError):
        del registry[6]
    c = Thing()
    registry[6] = c  # a reused descriptor replaces the dead entry
    assert registry[6] is c and len(registry._refs) == 2
    del registry[5]
    assert 5 not in registry and list(registry) == [6]


def test_uvloop_loops_use_the_registry() -> None:
    """In a fresh interpreter (this one may have imported uvloop already): the
    loop's registry is an FdRegistry, it refuses add_reader on a live
    transport's descriptor as uvloop's own does, and weakref is left as it was."""
    code = textwrap.dedent(
        """
        import asyncio, gc, socket, weakref
        from scry.event_loop import FdRegistry, run

        async def main():
            loop = asyncio.get_running_loop()
            registries = [o for o in gc.get_referents(loop) if isinstance(o, FdRegistry)]
            assert len(registries) == 1, gc.get_referents(loop)
            ours, theirs = socket.socketpair()
            transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
            fd = transport.get_extra_info("socket").fileno()
            assert registries[0][fd] is transport
            try:
                loop.add_reader(fd, print)
            except RuntimeError as exc:
                assert "is used by transport" in str(exc), exc
            else:
                raise AssertionError("add_reader on a transport's descriptor")
            transport.close()
            await asyncio.sleep(0)
            theirs.close()
            return "ok"

        assert run(main()) == "ok"
        assert weakref.WeakValueDictionary.__module__ == "weakref"
        import uvloop.loop
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
