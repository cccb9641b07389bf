"""The operating-system user a pgbouncer.ini asks scry to run as (PgBouncer's
``user`` setting, or ``-u``).

As in PgBouncer, a process started as root reads its configuration as root
(the ini, ``auth_file``, ``auth_hba_file``, TLS keys and certificates) and
becomes the user before it listens, so that nothing it does for a client
runs with root's rights. Files it creates on the way (``pidfile``, a new
``logfile``) are given to the user, who must be able to remove them. Unlike
PgBouncer, the user's supplementary groups are kept (``initgroups``): a key
readable through a group such as ``ssl-cert`` is still readable on reload.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path


class AccountError(Exception):
    """The user cannot be switched to; the message names it and why."""


def find_account(name: str) -> pwd.struct_passwd:
    """The account to become, checked before anything is started."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise AccountError(f"user {name!r}: no such user to switch to") from None
    uid = os.getuid()
    if uid not in (0, account.pw_uid):
        raise AccountError(
            f"user {name!r}: only root can switch to another user (this process runs as uid {uid})"
        )
    return account


def hand_over(path: str | Path, account: pwd.struct_passwd | None) -> None:
    """Give a file made before the switch to the user it will belong to."""
    if account is not None and os.geteuid() == 0:
        os.chown(path, account.pw_uid, account.pw_gid)


def become(account: pwd.struct_passwd) -> None:
    """Switch this process to ``account`` for good: groups first, then the
    group, then the user (as root, setuid also sets the saved uid, so there
    is no way back)."""
    if os.getuid() == os.geteuid() == account.pw_uid:
        return
    os.initgroups(account.pw_name, account.pw_gid)
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    os.environ.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
