"""A client's way in: startup packet, TLS, authentication, the login greeting.

``ClientLogin`` is the first half of :class:`scry.client.ClientConnection`
(a mixin, so the connection stays one object and one ``asyncio.Protocol``):

    startup (SSLRequest/GSSENCRequest/CancelRequest/StartupMessage, direct TLS)
      -> auth (trust, md5, SCRAM, certificate)
      -> login (the pool's first server, settings spelled as PostgreSQL does)
      -> ready: the greeting is sent and :mod:`scry.client`'s relay takes over.

It reads and sets the connection's fields (``state``, ``user``, ``params``,
``pool``, ``tracker`` ...) and calls its ``fatal``, ``_cleanup`` and ``_relay``.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import functools
import logging
import pwd
import ssl

from scry.auth import PASSWORD_METHODS
from scry.auth_query import look_up_secret
from scry.config import DatabaseTarget
from scry.hybrid import SessionTracker, TransactionTracker
from scry.log import connection_event, event, logging_connections
from scry.observe.record import ClientContext
from scry.pool import Pool, connect_error
from scry.protocol import messages as m
from scry.protocol import startup as st
from scry.protocol.auth import AuthStep, ClientAuthExchange
from scry.protocol.errors import (
    ADMIN_SHUTDOWN,
    CONNECTION_FAILURE,
    FEATURE_NOT_SUPPORTED,
    INVALID_AUTHORIZATION,
    PROTOCOL_VIOLATION,
    TOO_MANY_CONNECTIONS,
    ProtocolViolation,
)
from scry.protocol.framing import MessageReader
from scry.relay_core import AUTH, CLOSED, COMPILED, LOGIN, READY, STARTUP, LoginPlan
from scry.server import ServerLoginError
from scry.tls import peer_common_name

# GUC names are case-insensitive; ParameterStatus uses these spellings.
_CANONICAL = {"datestyle": "DateStyle", "intervalstyle": "IntervalStyle", "timezone": "TimeZone"}
# Startup keys that are not settings.
_NOT_SETTINGS = frozenset({"user", "database", "options", "replication"})

_READY_IDLE = m.ready_for_query()
_MAX_PLANS = 256  # distinct StartupMessages remembered (then forgotten all at once)


def canonical_name(name: str) -> str:
    lower = name.lower()
    return _CANONICAL.get(lower, lower)


def parse_options(options: str) -> dict[str, str]:
    """Settings from a startup ``options`` string (``-c name=value`` / ``--name=value``)."""
    tokens: list[str] = []
    current = []
    escaped = False
    for ch in options:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch.isspace():
            if current:
                tokens.append("".join(current))
                current = []
        else:
            current.append(ch)
    if current:
        tokens.append("".join(current))
    settings: dict[str, str] = {}
    it = iter(tokens)
    for token in it:
        if token == "-c":
            token = next(it, "")
        elif token.startswith("-c") or token.startswith("--"):
            token = token[2:]
        else:
            raise ProtocolViolation(f"unsupported startup option {token!r}", FEATURE_NOT_SUPPORTED)
        name, sep, value = token.partition("=")
        if not sep or not name:
            raise ProtocolViolation(f"invalid startup option {token!r}", FEATURE_NOT_SUPPORTED)
        settings[canonical_name(name.replace("-", "_"))] = value
    return settings


def _os_user(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _valid_setting_name(name: str) -> bool:
    return name.replace("_", "a").replace(".", "a").isalnum()


# An application opens its connections with the same startup parameters: their
# settings are worked out once. The dicts are shared, never changed in place
# (a client's settings are replaced when they change), which also lets
# ServerConnection.link see "same settings" by identity instead of comparing.
_SETTINGS_CACHE: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
_SETTINGS_CACHE_MAX = 1024


def startup_settings(params: dict[str, str]) -> dict[str, str]:
    """The settings a StartupMessage asks for (ProtocolViolation if one is malformed)."""
    key = tuple(params.items())
    settings = _SETTINGS_CACHE.get(key)
    if settings is None:
        # As in PostgreSQL, a setting named on its own wins over ``options``.
        options = params.get("options")
        settings = parse_options(options) if options else {}
        for name, value in params.items():
            if name in _NOT_SETTINGS:
                continue
            canonical = canonical_name(name)
            if not _valid_setting_name(canonical):
                raise ProtocolViolation(f"unsupported startup parameter: {name}")
            settings[canonical] = value
        if len(_SETTINGS_CACHE) >= _SETTINGS_CACHE_MAX:
            _SETTINGS_CACHE.clear()
        _SETTINGS_CACHE[key] = settings
    return settings


@functools.lru_cache(maxsize=8)
def _ignored_names(parameters: tuple[str, ...]) -> frozenset[str]:
    """ignore_startup_parameters as canonical setting names (worked out once per list)."""
    return frozenset(canonical_name(name) for name in parameters)


def lenient_options(
    params: dict[str, str], ignored: frozenset[str]
) -> tuple[dict[str, str], frozenset[str]]:
    """``params`` as a login reads them when PgBouncer's ignore_startup_parameters
    (``ignored``, canonical names) lists ``options``, and the settings its login
    may go without: PgBouncer drops such a client's whole options string, so
    scry never refuses it. A malformed one is left out; otherwise each setting
    it alone gives is applied if PostgreSQL accepts it and dropped if not."""
    try:
        from_options = parse_options(params["options"])
    except ProtocolViolation:
        return {k: v for k, v in params.items() if k != "options"}, ignored
    named = {canonical_name(name) for name in params}
    return params, ignored | (from_options.keys() - named)


class ClientLogin:
    """Startup, TLS and authentication of a :class:`~scry.client.ClientConnection`."""

    __slots__ = ()  # the attributes are ClientConnection's

    def _startup_data(self, data: bytes) -> None:
        buf = self._startup_buf
        if not buf and not self.tls and data[:1] == b"\x16":
            # A TLS ClientHello with no SSLRequest first: PostgreSQL 17's direct
            # TLS negotiation (sslnegotiation=direct, ALPN "postgresql").
            self._direct_tls(data)
            return
        buf += data
        while self.state is STARTUP:
            try:
                parsed = st.read_startup_packet(buf)
            except ProtocolViolation as exc:
                self.fatal(exc.sqlstate, str(exc))
                return
            if parsed is None:
                return
            packet, used = parsed
            raw = bytes(buf) if COMPILED and used == len(buf) else None  # (a plan's key)
            del buf[:used]
            if isinstance(packet, st.SSLRequest):
                context = self.proxy.client_tls.context
                if context is None or self.tls:
                    self.transport.write(b"N")
                else:
                    self._upgrade_to_tls(context)
                    return
            elif isinstance(packet, st.GSSENCRequest):
                self.transport.write(b"N")  # no GSSAPI encryption; the client may go on
            elif isinstance(packet, st.CancelRequest):
                done = self.proxy.handle_cancel(packet.pid, packet.secret)
                if done is None:
                    self._cleanup("cancel request", quiet=True)
                else:
                    # Closed once PostgreSQL has acted on it (scry.proxy.handle_cancel).
                    self.transport.pause_reading()
                    done.add_done_callback(lambda _: self._cancel_forwarded())
                return
            else:
                self._begin_login(packet, raw)

    def _cancel_forwarded(self) -> None:
        if self.state is not CLOSED:  # (unless client_login_timeout closed it first)
            self._cleanup("cancel request", quiet=True)

    def _direct_tls(self, hello: bytes) -> None:
        context = self.proxy.client_tls.context
        if context is None:
            event("direct TLS from a client, but client TLS is disabled", logging.WARNING,
                  client=self.id, addr=self.addr)  # fmt: skip
            self._cleanup("direct TLS without client_tls", quiet=True)
            return
        # The ClientHello is already read, so asyncio's start_tls cannot be used:
        # put an SSL protocol between the transport and us by hand and hand it
        # the bytes we took (asyncio's SSLProtocol works on memory BIOs).
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        tls = asyncio.sslproto.SSLProtocol(
            loop, self, context, waiter, server_side=True, call_connection_made=False,
            ssl_handshake_timeout=30,
        )  # fmt: skip
        raw = self.transport
        raw.set_protocol(tls)
        tls.connection_made(raw)
        self.transport = tls._app_transport  # type: ignore[assignment]
        self.tls = True
        loop.create_task(self._direct_tls_done(waiter))
        view = memoryview(hello)
        while view:  # SSLProtocol is a BufferedProtocol: copy into its buffer
            buffer = tls.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    async def _direct_tls_done(self, waiter: asyncio.Future[None]) -> None:
        try:
            await waiter
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            event("client TLS handshake failed", logging.WARNING, client=self.id,
                  error=str(exc) or type(exc).__name__)  # fmt: skip
            if self.state is not CLOSED:
                self._cleanup("TLS handshake failed", quiet=True)
            return
        selected = self.transport.get_extra_info("ssl_object")
        if selected is not None and selected.selected_alpn_protocol() != "postgresql":
            # PostgreSQL requires the ALPN for direct TLS; so do we.
            self.fatal(PROTOCOL_VIOLATION, "direct TLS requires ALPN protocol postgresql")

    def _upgrade_to_tls(self, context: ssl.SSLContext) -> None:
        # Nothing may be read between our 'S' and the handshake taking over.
        self.transport.pause_reading()
        self.transport.write(b"S")
        asyncio.get_running_loop().create_task(self._tls_handshake(context))

    async def _tls_handshake(self, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport = await loop.start_tls(
                self.transport, self, context, server_side=True, ssl_handshake_timeout=30
            )
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            event("client TLS handshake failed", logging.WARNING, client=self.id,
                  addr=self.addr, error=str(exc) or type(exc).__name__)  # fmt: skip
            self._cleanup("TLS handshake failed", quiet=True)
            self.transport.abort()
            return
        if transport is None or self.state is CLOSED:
            return
        self.transport = transport  # type: ignore[assignment]
        self.tls = True
        if self._startup_buf:
            self._startup_data(b"")

    def _begin_login(self, packet: st.StartupMessage, raw: bytes | None = None) -> None:
        """Check a StartupMessage and start authenticating; ``raw`` is the
        packet's bytes when nothing came after it (see _plan_login)."""
        proxy = self.proxy
        params = packet.params
        if packet.newer_than_spoken:
            # As PostgreSQL: tell a client asking for 3.2 (or protocol options)
            # that we speak 3.0 and none of the options, then go on in 3.0.
            options = packet.options
            self.transport.write(m.negotiate_protocol_version(0, options))
            params = {name: value for name, value in params.items() if name not in options}
            raw = None  # (a login plan would skip this answer)
        self.user = packet.user
        self.database = packet.database
        if proxy.client_tls.required and not self.tls:
            self.fatal(INVALID_AUTHORIZATION, "SSL required",
                       detail=f"tls.client_tls_sslmode is {proxy.client_tls.mode}")  # fmt: skip
            return
        method = proxy.auth.method
        user_map = None
        if proxy.auth.hba is not None:
            chosen = self._hba_method(packet.database)
            if chosen is None:
                return
            method, user_map = chosen
        if method == "cert" or proxy.client_tls.mode == "verify-full":
            common_name = peer_common_name(self.transport) if self.tls else None
            if not proxy.auth.proves(common_name, self.user, user_map):
                event("client login failed", logging.WARNING, client=self.id, addr=self.addr,
                      user=self.user, reason="certificate CN does not match")  # fmt: skip
                self.fatal(
                    INVALID_AUTHORIZATION,
                    f'certificate authentication failed for user "{self.user}"',
                )
                return
        if "replication" in params and params["replication"] not in ("false", "off", "0"):
            self.fatal(FEATURE_NOT_SUPPORTED, "replication connections are not supported by scry")
            return
        if proxy.draining:
            self.fatal(ADMIN_SHUTDOWN, "scry is shutting down")
            return
        if proxy.client_count > proxy.config.pool.max_client_conn:
            self.fatal(TOO_MANY_CONNECTIONS, "no more connections allowed (max_client_conn)")
            return
        if proxy.config.pgbouncer is not None:
            # PgBouncer mode: the console, DISABLE, SUSPEND, '*' and [users].
            from scry.pgbouncer.console import route_login

            if route_login(self, packet, params, method):
                return
        self.login_to_database(params, method, raw)

    def login_to_database(
        self, params: dict[str, str], method: str, raw: bytes | None = None
    ) -> None:
        """The rest of a login, once its StartupMessage passed the checks: the
        target, the startup settings and the secret to check."""
        proxy = self.proxy
        target = proxy.targets.get(self.database)
        if target is None:
            self.fatal(PROTOCOL_VIOLATION, f"no such database: {self.database}")
            return
        if proxy.config.pgbouncer is not None:
            ignored = _ignored_names(tuple(proxy.config.pgbouncer.ignore_startup_parameters))
            if "options" in ignored and "options" in params:
                params, ignored = lenient_options(params, ignored)
            self._droppable = ignored
        try:
            settings = startup_settings(params)
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return
        self.application_name = settings.get("application_name", "")
        if proxy.config.application_name_add_host:  # (a copy: settings are shared, cached)
            settings = {**settings, "application_name": f"{self.application_name} - {self.addr}"}
        self.params = settings
        if proxy.auth.looks_up(target, self.user, method):
            self.state = AUTH  # (what the client sends meanwhile waits in _startup_buf)
            asyncio.get_running_loop().create_task(self._look_up_and_authenticate(target, method))
            return
        self._authenticate(target, method, proxy.auth.secret_for(self.user), raw)

    async def _look_up_and_authenticate(self, target: DatabaseTarget, method: str) -> None:
        """auth_query finds the secret; every login asks again, so a changed
        or expired password applies at once (as in PgBouncer)."""
        try:
            secret = await look_up_secret(self.proxy, target, self.user)
        except Exception as exc:  # (AuthQueryError, or a server gone mid-lookup)
            if self.state is AUTH:
                event("auth_query failed", logging.WARNING, client=self.id, user=self.user,
                      db=self.database, error=str(exc) or type(exc).__name__)  # fmt: skip
                # The reason is logged; an unauthenticated client is not told it.
                self.fatal(CONNECTION_FAILURE, f'could not look up user "{self.user}" (auth_query)')
            return
        if self.state is AUTH:
            self._authenticate(target, method, secret, None)

    def _authenticate(
        self,
        target: DatabaseTarget,
        method: str,
        secret: str | None,
        raw: bytes | None,
    ) -> None:
        """Choose the pool and start the exchange that checks ``secret``."""
        proxy = self.proxy
        if secret is None and method in PASSWORD_METHODS and not target.user:
            # No such user: the exchange still runs to its failing end (a probe
            # cannot tell unknown users from wrong passwords), but no pool is
            # made, and kept, for a name anyone can make up.
            raw = None
        else:
            server_user, server_password = proxy.auth.server_credentials(target, self.user, secret)
            pool = self.pool = proxy.pool_for(target, server_user, server_password)
            if pool.server_password != server_password:
                # A looked-up secret changed since (or the pool was made before
                # the lookup): new servers use the one just found.
                pool.server_password = server_password
            if (over := self._client_limit_reached()) is not None:
                self.fatal(TOO_MANY_CONNECTIONS, f"no more connections allowed ({over})")
                return
            self.stats = pool.stats
            mode = pool.mode
            self.transaction_pooling = mode != "session"
            self.statement_pooling = mode == "statement"
            self.refuse_query = proxy.config.disable_pqexec
            self.tracker = self._new_tracker(mode)
            self._spell_as_postgres(pool.setting_spellings)
        self._auth = ClientAuthExchange(
            method, self.user, secret, scram_iterations=proxy.auth.scram_iterations
        )
        self._reader = MessageReader(proxy.config.max_packet_size)
        self.state = AUTH
        rest = bytes(self._startup_buf)  # anything the client sent after its startup packet
        self._startup_buf.clear()
        if raw is not None:
            self._plan_login(raw)
        self._auth_step(self._auth.start())
        if rest:
            self.data_received(rest)

    def _client_limit_reached(self) -> str | None:
        """max_db_client_connections / max_user_client_connections: the one this
        client would exceed (it is counted among the clients already), if any."""
        assert self.pool is not None
        settings = self.pool.settings
        for limit, name, mine in (
            (settings.max_db_client_connections, "max_db_client_connections",
             lambda c: c.database == self.database),
            (settings.max_user_client_connections, "max_user_client_connections",
             lambda c: c.user == self.user),
        ):  # fmt: skip
            if limit and sum(1 for c in self.proxy.clients if mine(c)) > limit:
                return name
        return None

    def _hba_method(self, database: str) -> tuple[str, str | None] | None:
        """auth.type hba: the method the first matching rule names and its
        user name map, or None (the client was refused, as PostgreSQL refuses it)."""
        hba = self.proxy.auth.hba
        assert hba is not None
        addr = self.addr
        local = addr == "unix"
        host = None if local else addr.rsplit(":", 1)[0]
        method, rule = hba.method_for(
            local=local, tls=self.tls, host=host, database=database, user=self.user
        )
        if method == "peer":  # (local: the Unix socket, which PgBouncer mode opens)
            from scry.pgbouncer.results import peer_uid

            peer = peer_uid(self.transport)
            os_user = _os_user(peer[1]) if peer is not None else None
            assert rule is not None  # (a rule chose peer)
            if self.proxy.auth.proves(os_user, self.user, rule.user_map):
                return "trust", None
            reason = f"peer: OS user {os_user or 'unknown'}"
            if rule.user_map is not None:
                reason += f", not in map {rule.user_map} as {self.user}"
            message = f'Peer authentication failed for user "{self.user}"'
        elif method != "reject":
            return method, rule.user_map if rule is not None else None
        else:
            reason = "no rule matches" if rule is None else f"line {rule.line} rejects"
            refusal = "no pg_hba.conf entry" if rule is None else "pg_hba.conf rejects connection"
            message = (
                f'{refusal} for host "{"[local]" if local else host}", user "{self.user}", '
                f'database "{database}", {"SSL encryption" if self.tls else "no encryption"}'
            )
        event("client login failed", logging.WARNING, client=self.id, addr=addr,
              user=self.user, db=database, reason=f"hba: {reason}")  # fmt: skip
        self.fatal(INVALID_AUTHORIZATION, message)
        return None

    def _new_tracker(self, mode: str) -> SessionTracker | None:
        if mode == "hybrid" or (mode != "session" and not self.proxy.observatory.enabled):
            return SessionTracker(self.id, pinning=mode == "hybrid")
        if mode != "session":
            return TransactionTracker(self.id)  # the drain warns, off the query path
        return None

    def _plan_login(self, raw: bytes) -> None:
        """Remember what this login worked out, for the compiled ClientCore to
        log the next client that sends the same StartupMessage straight in
        (pgbench -C, or any pool of connections an application opens alike):
        only for md5 and trust over plain TCP, when the pool's first server
        is up and no setting needs checking, and outside PgBouncer mode (its
        console and DISABLE route logins). A reload forgets every plan."""
        proxy = self.proxy
        auth, pool = self._auth, self.pool
        assert auth is not None and pool is not None
        if (
            auth.method not in ("md5", "trust")
            or (auth.method == "md5" and auth.secret is None)
            or proxy.auth.hba is not None  # (a plan would serve any address)
            or pool.settings.max_db_client_connections  # (a plan would not count them)
            or pool.settings.max_user_client_connections
            or proxy.config.application_name_add_host  # (a plan would reuse one address)
            or proxy.config.disable_pqexec  # (a plan does not carry it)
            or self.tls
            or proxy.config.pgbouncer is not None
            or proxy.client_tls.mode != "disable"
            or pool.welcome is None
            or self._settings_to_check(pool.welcome)
            or self._standard_strings() != "on"  # (a plan's records read strings as "on")
        ):
            return
        plan = LoginPlan()
        plan.max_client_conn = proxy.config.pool.max_client_conn
        plan.user, plan.database = self.user, self.database
        plan.settings, plan.application_name = self.params, self.application_name
        plan.pool, plan.welcome = pool, pool.welcome
        plan.greeting = pool.login_greeting(self.params)
        plan.method, plan.secret = auth.method, auth.secret
        plan.md5_inner = auth.md5_inner() if auth.method == "md5" else None
        plan.transaction_pooling = self.transaction_pooling
        plan.statement_pooling = self.statement_pooling
        # The tracker _new_tracker made, to make its like with no Python call.
        tracker = self.tracker
        plan.tracker_type = None if tracker is None else type(tracker)
        plan.tracker_pinning = tracker is not None and tracker.pinning
        plans = proxy.login_plans
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[raw] = plan

    def _auth_data(self, data: bytes) -> None:
        if self._auth is None and self._plan is None:  # auth_query still looking
            self._startup_buf += data
            return
        reader = self._reader
        if reader is None:  # a planned login (ClientCore._startup_fast) the fast path left
            reader = self._reader = MessageReader(self.proxy.config.max_packet_size)
        if self._auth is None:
            plan = self._plan
            self._auth = ClientAuthExchange(plan.method, plan.user, plan.secret, salt=self._salt)
            self._plan = self._salt = None
        reader.feed(data)
        try:
            while self.state is AUTH and (msg := reader.next_message()) is not None:
                self._auth_step(self._auth.handle(*msg))
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))

    def _auth_step(self, step: AuthStep) -> None:
        if step.error is not None:
            sqlstate, text = step.error
            event("client login failed", logging.WARNING, client=self.id, addr=self.addr,
                  user=self.user, db=self.database, reason=text)  # fmt: skip
            self.fatal(sqlstate, text)
            return
        if step.reply:
            self.transport.write(step.reply)
        if step.done:
            self.state = LOGIN
            auth = self._auth
            if auth is not None and auth.client_key is not None and auth.secret is not None:
                self.proxy.scram_keys[self.user] = (auth.secret, auth.client_key)
            self._auth = None
            pool = self.pool
            assert pool is not None
            if pool.welcome is not None and not self._settings_to_check(pool.welcome):
                self._complete_login(pool.welcome)  # the common case: no task, no await
            else:
                asyncio.get_running_loop().create_task(self._finish_login())

    def _spell_as_postgres(self, known: dict[tuple[str, str], str]) -> None:
        """Startup settings this pool has seen PostgreSQL spell otherwise
        (``DateStyle=iso`` is ``ISO, MDY``), in its spelling: a login that
        needs no check (or a plan made from it) still greets the client with
        what PostgreSQL would report."""
        params = self.params
        if known and any(known.get((k, v), v) != v for k, v in params.items()):
            self.params = {k: known.get((k, v), v) for k, v in params.items()}

    def _settings_to_check(self, welcome: dict[str, str]) -> dict[str, str]:
        """Startup settings PostgreSQL must see before the login ends, until
        this pool has seen it accept them (Pool.check_settings): the reported
        ones that differ from its defaults, which it may spell otherwise, and
        all the others."""
        known = self.pool.setting_spellings
        return {
            k: v
            for k, v in self.params.items()
            if k != "application_name"
            and (k, v) not in known
            and (k not in welcome or v != welcome[k])
        }

    async def _finish_login(self) -> None:
        """Login that needs the pool first: its first server, or a settings check."""
        pool = self.pool
        assert pool is not None
        told: dict[str, str] | None = None  # (the settings a greeting before the check said)
        try:
            await pool.ensure_welcome()
            if self.state is not LOGIN:
                return
            assert pool.welcome is not None
            to_check = self._settings_to_check(pool.welcome)
            if to_check:
                refused = pool.refused_settings
                if pool.paused and any(pair not in refused for pair in to_check.items()):
                    # The check needs a server, and none is handed out until
                    # RESUME. As PgBouncer does, the login ends now and what
                    # the client sends waits; a refusal ends the session.
                    self._greet(pool)
                    told = self.params
                try:
                    droppable = getattr(self, "_droppable", frozenset())  # (PgBouncer mode)
                    spelled = await pool.check_settings(to_check, droppable)
                except TimeoutError:  # (no server came free to check them on)
                    raise ServerLoginError(
                        {"C": PROTOCOL_VIOLATION, "M": "query_wait_timeout"}
                    ) from None
                self.params = {
                    k: spelled.get(k, v)
                    for k, v in self.params.items()
                    if k in spelled or k not in to_check  # (else ignored: refused, but listed)
                }
        except Exception as exc:
            if self.state is LOGIN:
                if isinstance(exc, ServerLoginError):  # PostgreSQL's own words
                    fields = exc.fields
                    self.fatal(exc.sqlstate, str(exc), fields.get("D"), fields.get("H"))
                else:
                    self.fatal(*connect_error(exc))
            return
        if self.state is LOGIN:
            self._complete_login(pool.welcome, told)

    def _complete_login(self, welcome: dict[str, str], told: dict[str, str] | None = None) -> None:
        """Greet the client, unless it was greeted with ``told`` as its settings
        (during PAUSE, before the check): then tell it what the check changed
        (PostgreSQL's spelling, a dropped setting), as PostgreSQL reports a change."""
        pool = self.pool
        assert pool is not None
        if told is None:
            self._greet(pool)
        else:
            params = self.params
            changed = b"".join(
                m.parameter_status(name, params.get(name, default))
                for name, default in welcome.items()
                if params.get(name, default) != told.get(name, default)
            )
            if changed:
                self.transport.write(changed)
        self.state = READY
        self.context = self.new_context()
        if logging_connections():  # (the address costs a getpeername syscall)
            self._log_login()
        early = self._reader.take_remaining() if self._reader is not None else b""
        self._reader = None
        if self._paused_waiting:  # (it sent much while it waited: the relay bounds it now)
            self._paused_waiting = False
            self._update_reading()
        if early:
            self._relay(early)

    def _greet(self, pool: Pool) -> None:
        """AuthenticationOk, ParameterStatus, BackendKeyData and ReadyForQuery."""
        pid, secret = self.proxy.register_cancel_key(self)
        self.transport.write(
            pool.login_greeting(self.params) + m.backend_key_data(pid, secret) + _READY_IDLE
        )

    def new_context(self) -> ClientContext:
        """The context of this client's records, as its session stands now."""
        nonstandard = self._standard_strings() == "off"
        if nonstandard:
            self.proxy.observatory.nonstandard_strings = True
        tracker = self.tracker
        if tracker is not None:
            tracker.nonstandard_strings = nonstandard
        return ClientContext(
            self.id, self.database, self.user, self.application_name, self.proxy.worker_id,
            nonstandard,
        )  # fmt: skip

    def _standard_strings(self) -> str:
        """standard_conforming_strings as this client's session has it."""
        value = self.params.get("standard_conforming_strings")
        if value is None:
            welcome = self.pool.welcome if self.pool is not None else None
            value = (welcome or {}).get("standard_conforming_strings", "on")
        return value

    def _log_login(self) -> None:
        connection_event("client login", client=self.id, addr=self.addr, user=self.user,
              db=self.database, app=self.application_name, pool=self.pool.name)  # fmt: skip
