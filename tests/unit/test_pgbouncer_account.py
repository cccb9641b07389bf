"""scry.pgbouncer.account: which switches a process may make (the switch
itself, which needs root, is tested in tests/integration/test_pgbouncer_user.py)."""

from __future__ import annotations

import os
import pwd

import pytest

from scry.pgbouncer.account import AccountError, find_account


def test_an_unknown_user_is_named() -> None:
    with pytest.raises(AccountError, match="'scry_no_such_user': no such user"):
        find_account("scry_no_such_user")


def test_a_user_other_than_root_may_only_be_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    other = next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.getuid()))
    monkeypatch.setattr(os, "getuid", lambda: other.pw_uid)
    assert find_account(other.pw_name).pw_uid == other.pw_uid
    with pytest.raises(AccountError, match="only root can switch to another user"):
        find_account("root")


def test_root_may_become_anyone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert find_account("root").pw_uid == 0
    nobody = next(p for p in pwd.getpwall() if p.pw_uid != 0)
    assert find_account(nobody.pw_name).pw_uid == nobody.pw_uid
