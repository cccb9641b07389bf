"""Cancel keys (BackendKeyData) scry hands to clients: unpredictable, owner-encoded."""

from __future__ import annotations

import random

import pytest

from scry import peering
from scry.peering import KEY_MASK, RANDOM_MASK, key_owner, new_cancel_key


def test_cancel_keys_come_from_the_os_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Mersenne Twister's output can be predicted from the keys a client sees.
    def no_prng(*_args: object) -> int:
        raise AssertionError("cancel keys must not come from the random module")

    monkeypatch.setattr(random, "getrandbits", no_prng)
    monkeypatch.setattr(random, "randrange", no_prng)
    drawn: list[int] = []

    def urandom(n: int) -> bytes:
        drawn.append(n)
        return bytes(range(256)) * (n // 256) + bytes(n % 256)

    peering._key_words.clear()
    monkeypatch.setattr(peering.os, "urandom", urandom)
    pid, secret = new_cancel_key(3, 2)
    assert drawn, "os.urandom was not used"
    # The last 64-bit word of what was read: its low 32 bits are the secret.
    assert secret == int.from_bytes(bytes(range(248, 252)), "little")
    assert key_owner(pid) == (3, 2)
    peering._key_words.clear()  # nothing derived from the fake bytes outlives the test


def test_cancel_keys_are_distinct_and_name_their_owner() -> None:
    keys = {new_cancel_key(5, 1) for _ in range(20_000)}
    assert len(keys) == 20_000
    for pid, secret in keys:
        assert key_owner(pid) == (5, 1)
        assert pid & RANDOM_MASK != 0  # never all zero
        assert pid & KEY_MASK == pid and 0 < pid < 2**31
        assert 0 <= secret < 2**32
    # The 32 secret bits are spread (not a counter, not stuck bits).
    ones = [sum((secret >> bit) & 1 for _, secret in keys) for bit in range(32)]
    assert all(8_000 < count < 12_000 for count in ones)
