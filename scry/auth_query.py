"""auth_query: a client's secret looked up in PostgreSQL when it logs in.

PgBouncer's ``auth_user`` / ``auth_query`` / ``auth_dbname``. A user with no
secret in ``auth.users`` or ``auth.auth_file`` is looked up on every login
(so a changed or expired password applies at once): ``auth_query`` runs with
the user name as ``$1`` on a server of the ``auth_user`` pool (the
database's own, or ``auth.auth_user``), in the client's database or in
``auth_dbname``. Its second column is the secret: plaintext,
md5 or SCRAM, as ``pg_authid.rolpassword`` holds it; no row or NULL means the
login fails as a wrong password would.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from scry.config import DEFAULT_AUTH_QUERY, DatabaseTarget
from scry.server import CLOSED, ServerLoginError

if TYPE_CHECKING:
    from scry.proxy import Proxy


class AuthQueryError(Exception):
    """The lookup could not run or gave an unusable answer (for the log, not the client)."""


async def look_up_secret(proxy: Proxy, target: DatabaseTarget, user: str) -> str | None:
    """The stored secret auth_query finds for ``user``, or None (no such login)."""
    auth = proxy.config.auth
    auth_user = target.auth_user or (auth.auth_user if auth else None)
    auth_dbname = target.auth_dbname or (auth.auth_dbname if auth else None)
    assert auth_user is not None
    where = proxy.targets[auth_dbname] if auth_dbname else target
    pool = proxy.pool_for(where, auth_user, proxy.auth.secret_for(auth_user))
    try:
        server = await pool.borrow()
    except ServerLoginError as exc:
        raise AuthQueryError(f"auth_user {auth_user!r} cannot log in: {exc}") from None
    except (TimeoutError, OSError) as exc:
        raise AuthQueryError(f"no server for auth_user {auth_user!r}: {exc}") from None
    answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    server.run_internal(
        target.auth_query or (auth.auth_query if auth else DEFAULT_AUTH_QUERY),
        lambda ok: answered.done() or answered.set_result(ok),
        resync=False,
        params=[user],
    )
    ok = await answered
    rows, fields = server.internal_rows, server.internal_error_fields
    server.internal_rows = None  # (the secret is not kept on the server)
    if server.state is not CLOSED:
        pool.release(server)
    if not ok:
        reason = fields.get("M", "failed") if fields else "no answer from the server"
        raise AuthQueryError(f"auth_query: {reason}")
    if not rows:
        return None
    if len(rows[0]) < 2:
        raise AuthQueryError("auth_query must return two columns: the user and the secret")
    secret = rows[0][1]
    return None if secret is None else secret.decode()
