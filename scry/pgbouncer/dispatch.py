"""The console's grammar: one simple Query in, its complete answer out.

PgBouncer's console understands ``CMD [arg] [;]`` and ``SET key = value``.
``SHOW x`` (or ``SELECT x``) goes to a view (:mod:`scry.pgbouncer.views`,
:mod:`scry.pgbouncer.stats`), any other command to :mod:`scry.pgbouncer.commands`
(admin users only). The settings drivers ask for on connect (client_encoding,
DateStyle ...) are faked, as PgBouncer fakes them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from scry.log import event
from scry.pgbouncer.commands import COMMANDS, set_setting
from scry.pgbouncer.instance import Route, answer_for_instance, route
from scry.pgbouncer.results import READY, TEXT, ConsoleError, error, ok, result
from scry.pgbouncer.state import state_for
from scry.pgbouncer.views import SHOWS
from scry.protocol import messages as m

if TYPE_CHECKING:
    from scry.pgbouncer.session import ConsoleSession
    from scry.proxy import Proxy

_WORD = r'("(?:[^"]|"")+"|[0-9a-z_]+)'
_CMD = re.compile(rf"^\s*{_WORD}(?:\s+{_WORD})?\s*(?:;\s*)?$", re.IGNORECASE)
_SET = re.compile(
    rf"^\s*set\s+{_WORD}\s*(?:=|to)\s*('(?:[^']|'')*'|{_WORD})\s*(?:;\s*)?$", re.IGNORECASE
)
# Settings clients like to SHOW/SET on connect; PgBouncer fakes them.
_FAKE_PARAMS = {
    "client_encoding": "UTF-8",
    "default_transaction_isolation": "read committed",
    "standard_conforming_strings": "on",
    "datestyle": "ISO",
    "timezone": "GMT",
    "extra_float_digits": "2",
}
_HELP = (
    "\n\tSHOW HELP|CONFIG|DATABASES|POOLS|CLIENTS|SERVERS|USERS|VERSION\n"
    "\tSHOW PEERS|PEER_POOLS\n"
    "\tSHOW FDS|SOCKETS|ACTIVE_SOCKETS|LISTS|MEM|STATE\n"
    "\tSHOW DNS_HOSTS|DNS_ZONES\n"
    "\tSHOW STATS|STATS_TOTALS|STATS_AVERAGES|TOTALS\n"
    "\tSHOW PINS|BREAKER|FINGERPRINTS (scry)\n"
    "\tSET key = arg\n"
    "\tRELOAD\n"
    "\tPAUSE [<db>]\n"
    "\tRESUME [<db>]\n"
    "\tDISABLE <db>\n"
    "\tENABLE <db>\n"
    "\tRECONNECT [<db>]\n"
    "\tKILL [<db>]\n"
    "\tKILL_CLIENT <client_id>\n"
    "\tSUSPEND\n"
    "\tSHUTDOWN\n"
    "\tSHUTDOWN WAIT_FOR_SERVERS|WAIT_FOR_CLIENTS\n"
    "\tWAIT_CLOSE [<db>]"
)


class AdminConsole:
    """Answers the ``pgbouncer`` console's SQL for one user.

    ``admin`` users may run everything; others (stats_users) only SHOW.
    """

    def __init__(
        self,
        proxy: Proxy,
        user: str,
        *,
        admin: bool,
        session: ConsoleSession | None = None,
        local: bool = False,
    ) -> None:
        self.proxy = proxy
        self.user = user
        self.admin = admin
        self.session = session
        self.state = state_for(proxy)
        self.workers = proxy.identity.workers
        #: Answer for this worker alone (asked by the worker a session is on).
        self.local = local

    def handle_query(self, sql: str) -> bytes | Awaitable[bytes]:
        """The full answer (ending in ReadyForQuery) to one simple Query; with
        several workers, for the whole instance (scry.pgbouncer.instance)."""
        if self.workers > 1 and not self.local:
            return answer_for_instance(self, sql, *_route(sql))
        return self.answer_here(sql)

    def answer_here(self, sql: str) -> bytes | Awaitable[bytes]:
        """The answer of this worker alone."""
        try:
            return self._dispatch(sql)
        except ConsoleError as exc:
            if not self.local:  # (the worker that asked logs it, once)
                event("console error", logging.WARNING, user=self.user, error=_loggable(str(exc)))
            return error(str(exc)) + READY

    def _dispatch(self, sql: str) -> bytes | Awaitable[bytes]:
        match = _CMD.match(sql)
        if match:
            command = _unquote(match[1], '"').lower()
            arg = _unquote(match[2], '"') if match[2] else ""
            if command in ("show", "select"):
                return self._show(arg, sql)
            handler = COMMANDS.get(command)
            if handler is None:
                raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
            if not self.admin:
                raise ConsoleError("admin access needed")
            return handler(self, arg, sql)  # type: ignore[no-any-return]
        match = _SET.match(sql)
        if match:
            key = _unquote(match[1], '"')
            raw = match[2]
            value = _unquote(raw, "'") if raw.startswith("'") else _unquote(raw, '"')
            if key.lower() in _FAKE_PARAMS:
                return m.notice_response("SET ignored") + ok("SET")
            return set_setting(self, key, value)
        raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")

    def _show(self, what: str, sql: str) -> bytes:
        name = what.lower()
        if name in _FAKE_PARAMS:
            return result([(name, TEXT)], [[_FAKE_PARAMS[name]]], "SHOW")
        if name == "help":
            return m.notice_response("Console usage", detail=_HELP) + ok("SHOW")
        show = SHOWS.get(name)
        if show is None:
            raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
        if name == "fds" and not self.admin:
            raise ConsoleError("admin access needed")
        return show(self)


def _route(sql: str) -> tuple[Route, str]:
    """Where a statement runs with several workers, and its argument."""
    match = _CMD.match(sql)
    if match:
        arg = _unquote(match[2], '"') if match[2] else ""
        return route(_unquote(match[1], '"').lower(), arg), arg
    match = _SET.match(sql)
    if match and _unquote(match[1], '"').lower() not in _FAKE_PARAMS:
        return route("set", ""), ""
    return Route.HERE, ""


def _unquote(text: str, quote_char: str) -> str:
    if len(text) >= 2 and text[0] == quote_char and text[-1] == quote_char:
        return text[1:-1].replace(quote_char * 2, quote_char)
    return text


_INVALID = "invalid command '"
_INVALID_END = "', use SHOW HELP;"


def _loggable(text: str) -> str:
    """A console error for the log. PgBouncer's "invalid command '...'" quotes
    the whole statement, which the client sees; the log keeps its first word
    (the rest may hold a value: SELECT 'secret' ...)."""
    if not (text.startswith(_INVALID) and text.endswith(_INVALID_END)):
        return text
    words = text[len(_INVALID) : -len(_INVALID_END)].split(None, 1)
    return f"{_INVALID}{words[0] if words else ''} ...{_INVALID_END}"
