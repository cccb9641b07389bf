"""Password authentication exchanges, both directions, without I/O.

``ClientAuthExchange``
    scry authenticating a connecting client (trust, cleartext, md5,
    scram-sha-256). Feed it the client's password messages; it says what to
    send back and when the client is in or out.

``BackendAuthExchange``
    scry authenticating itself to PostgreSQL with the credentials of a
    ``database_url``: answers AuthenticationCleartext/MD5/SASL requests.

SCRAM is done by scramp; md5 is PostgreSQL's ``md5(md5(password || user) || salt)``.
A stored secret may be plaintext, an md5 secret (``md5`` + 32 hex digits, as in
PgBouncer's userlist.txt) or a SCRAM secret (``SCRAM-SHA-256$iter:salt$stored:server``).

SCRAM pass-through (PgBouncer's): a SCRAM secret cannot answer a server's
SCRAM challenge, but a client that proved its password against it has, in its
proof, given away the ClientKey (RFC 5802: ClientProof = ClientKey XOR
ClientSignature). With that key and the secret's ServerKey, scry can log in
to a server that stores the same secret. scramp checks every proof and
parses every message; it does not hand out the key or take one in place of
a password, so those two steps are done here.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
from typing import Any, NamedTuple

from scramp import ScramClient, ScramException, ScramMechanism

from scry.protocol import messages as m
from scry.protocol.errors import INVALID_AUTHORIZATION, INVALID_PASSWORD, PROTOCOL_VIOLATION

SCRAM_SHA_256 = "SCRAM-SHA-256"
_scram = ScramMechanism(SCRAM_SHA_256)
#: RFC 7677's minimum PBKDF2 rounds, which scramp holds both sides to.
SCRAM_MIN_ITERATIONS = 4096


def md5_secret(user: str, password: str) -> str:
    """PostgreSQL's stored md5 form of a password: ``md5`` + md5(password || user)."""
    return "md5" + hashlib.md5((password + user).encode()).hexdigest()


def md5_response(secret: str, salt: bytes) -> str:
    """What a client sends for AuthenticationMD5Password, from the md5 secret."""
    return "md5" + hashlib.md5(secret[3:].encode() + salt).hexdigest()


@functools.lru_cache(maxsize=1024)  # asked once per login; the secrets are few
def secret_kind(secret: str) -> str:
    """``plain``, ``md5`` or ``scram`` for a stored secret."""
    if secret.startswith(SCRAM_SHA_256 + "$"):
        return "scram"
    if len(secret) == 35 and secret.startswith("md5"):
        try:
            int(secret[3:], 16)
            return "md5"
        except ValueError:
            pass
    return "plain"


# Salts for users without a stored SCRAM secret are derived from the user name
# with a per-process key (PostgreSQL's scram_mock_salt idea): the same user
# always sees the same salt, so probes cannot tell unknown users apart.
_MOCK_SALT_KEY = os.urandom(32)
_salts: list[bytes] = []
os.register_at_fork(after_in_child=_salts.clear)  # a forked child draws its own


def _random_salt() -> bytes:
    """Four random bytes for an md5 challenge, from 4 KiB of the OS's CSPRNG
    cut up at a time (a pop per md5 login)."""
    if not _salts:
        pool = os.urandom(4096)
        _salts.extend([pool[i : i + 4] for i in range(0, 4096, 4)])
    return _salts.pop()


_UNKNOWN_USER_SECRET = os.urandom(16).hex()


def mock_salt(user: str) -> bytes:
    return hmac.new(_MOCK_SALT_KEY, user.encode(), hashlib.sha256).digest()[:16]


@functools.lru_cache(maxsize=1024)
def scram_auth_info(
    secret: str, user: str = "", iterations: int = SCRAM_MIN_ITERATIONS
) -> tuple[bytes, bytes, bytes, int]:
    """scramp's auth info (salt, stored_key, server_key, iterations) for a secret
    (a plaintext one is made into a SCRAM secret of ``iterations`` rounds).

    Cached: deriving keys from a plaintext password costs that many PBKDF2 rounds.
    """
    if secret_kind(secret) == "scram":
        _, params, keys = secret.split("$")
        iterations, salt = params.split(":")
        stored, server = keys.split(":")
        return (
            base64.b64decode(salt),
            base64.b64decode(stored),
            base64.b64decode(server),
            int(iterations),
        )
    salt, stored, server, rounds = _scram.make_auth_info(
        secret, iteration_count=iterations, salt=mock_salt(user)
    )
    return salt, stored, server, rounds


class AuthStep(NamedTuple):
    """What to do after a client message: send ``reply``; ``done`` if authenticated.
    (A NamedTuple: one is made per login message, and a frozen dataclass costs
    an ``object.__setattr__`` per field.)"""

    reply: bytes = b""
    done: bool = False
    error: tuple[str, str] | None = None  # (sqlstate, message) -> FATAL and close


_AUTHENTICATED = AuthStep(done=True)


@functools.lru_cache(maxsize=1024)
def _stored_md5(user: str, secret: str) -> str:
    """The md5 secret a client's md5 answer is checked against (once per user
    and secret, not per login: an md5 of the password each time adds up under
    pgbench -C's connection churn)."""
    return md5_secret(user, secret) if secret_kind(secret) == "plain" else secret


class ClientAuthExchange:
    """Authenticate a client by ``method`` against a stored ``secret``.

    ``secret`` None means the user is unknown: the exchange still runs to the
    end (so a probe cannot tell unknown users from wrong passwords) and fails.
    """

    def __init__(
        self,
        method: str,
        user: str,
        secret: str | None,
        *,
        salt: bytes | None = None,
        scram_iterations: int = SCRAM_MIN_ITERATIONS,
    ) -> None:
        self.user = user
        self._secret = secret
        kind = secret_kind(secret) if secret is not None else "plain"
        # As PostgreSQL does: an md5 request cannot be answered from a SCRAM
        # secret, so such users are asked for SCRAM instead.
        if method == "md5" and kind == "scram":
            method = "scram-sha-256"
        if method == "scram-sha-256" and kind == "md5":
            method = "md5"
        self.method = method
        # (``salt``: the md5 challenge already sent for this login)
        self._salt = _random_salt() if salt is None else salt
        self._scram_iterations = scram_iterations  # (for a plaintext secret)
        self._scram_server: Any = None
        #: After a SCRAM login against a SCRAM secret: the ClientKey the client
        #: proved, which lets scry log in to servers as this user (pass-through).
        self.client_key: bytes | None = None

    @property
    def secret(self) -> str | None:
        return self._secret

    def md5_inner(self) -> bytes:
        """The part of the stored md5 secret an answer hashes with the salt."""
        assert self._secret is not None
        return _stored_md5(self.user, self._secret)[3:].encode()

    def start(self) -> AuthStep:
        """The first message to send after the StartupMessage."""
        if self.method in ("trust", "any", "cert"):
            # cert: the proxy checked the client certificate's CN before this.
            return _AUTHENTICATED
        if self.method == "plain":
            return AuthStep(reply=m.auth_cleartext_password())
        if self.method == "md5":
            return AuthStep(reply=m.auth_md5_password(self._salt))
        if self.method == "scram-sha-256":
            return AuthStep(reply=m.auth_sasl([SCRAM_SHA_256]))
        return AuthStep(error=(INVALID_AUTHORIZATION, f"unsupported auth method {self.method}"))

    def handle(self, kind: int, body: bytes) -> AuthStep:
        """Process one message from the client during authentication."""
        if kind != m.PASSWORD[0]:
            return AuthStep(error=(PROTOCOL_VIOLATION, "expected a password response"))
        if self.method == "plain":
            return self._check_plain(body.rstrip(b"\x00").decode(errors="replace"))
        if self.method == "md5":
            return self._check_md5(body.rstrip(b"\x00").decode(errors="replace"))
        return self._scram_step(body)

    def _failed(self) -> AuthStep:
        return AuthStep(
            error=(INVALID_PASSWORD, f'password authentication failed for user "{self.user}"')
        )

    def _check_plain(self, given: str) -> AuthStep:
        secret = self._secret
        if secret is None:
            return self._failed()
        kind = secret_kind(secret)
        if kind == "plain":
            ok = hmac.compare_digest(given.encode(), secret.encode())
        elif kind == "md5":
            ok = hmac.compare_digest(md5_secret(self.user, given), secret)
        else:
            salt, stored, server, iterations = scram_auth_info(secret)
            _, stored2, server2, _ = _scram.make_auth_info(given, iterations, salt)
            ok = hmac.compare_digest(stored, stored2)
        return _AUTHENTICATED if ok else self._failed()

    def _check_md5(self, given: str) -> AuthStep:
        secret = self._secret
        if secret is None:
            return self._failed()
        expected = md5_response(_stored_md5(self.user, secret), self._salt)
        return _AUTHENTICATED if hmac.compare_digest(given, expected) else self._failed()

    def _scram_step(self, body: bytes) -> AuthStep:
        try:
            if self._scram_server is None:
                mechanism, data = m.parse_sasl_initial_response(body)
                if mechanism != SCRAM_SHA_256:
                    return AuthStep(
                        error=(PROTOCOL_VIOLATION, f"unsupported SASL mechanism {mechanism}")
                    )
                secret = self._secret
                # Unknown user: run the exchange against a random secret and fail.
                info = scram_auth_info(
                    _UNKNOWN_USER_SECRET if secret is None else secret,
                    self.user,
                    self._scram_iterations,
                )
                self._scram_server = _scram.make_server(lambda _username: info)
                self._scram_server.set_client_first(data.decode())
                return AuthStep(
                    reply=m.auth_sasl_continue(self._scram_server.get_server_first().encode())
                )
            client_final = body.decode()
            self._scram_server.set_client_final(client_final)
            if self._secret is None:
                return self._failed()
            if secret_kind(self._secret) == "scram":
                self.client_key = _proven_client_key(self._scram_server, client_final)
            return AuthStep(
                reply=m.auth_sasl_final(self._scram_server.get_server_final().encode()),
                done=True,
            )
        except ScramException:
            return self._failed()
        except (ValueError, UnicodeDecodeError):
            return AuthStep(error=(PROTOCOL_VIOLATION, "malformed SASL message"))


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _attributes(message: str) -> dict[str, str]:
    """``c=...,r=...,p=...`` as a dict (a message scramp has already parsed)."""
    return dict(part.split("=", 1) for part in message.split(","))


def _proven_client_key(server: Any, client_final: str) -> bytes:
    """The ClientKey in a client-final message scramp's ScramServer accepted:
    ClientProof XOR HMAC(StoredKey, AuthMessage), the AuthMessage built as
    scramp built it to check the proof."""
    attrs = _attributes(client_final)
    auth_message = f"{server.client_first_bare},{server.server_first},c={attrs['c']},r={attrs['r']}"
    key = _xor(base64.b64decode(attrs["p"]), _hmac(server.stored_key, auth_message))
    assert hashlib.sha256(key).digest() == server.stored_key  # (scramp checked just this)
    return key


class BackendAuthError(Exception):
    """PostgreSQL asked for something we cannot answer (e.g. no password configured)."""


class BackendAuthExchange:
    """Answer a backend's authentication requests with a user and password.

    ``password`` may be a stored secret. A SCRAM secret answers a SCRAM
    request only with ``client_key``, the ClientKey a client proved against
    that very secret (pass-through); an md5 secret answers an md5 request.
    """

    def __init__(self, user: str, password: str | None, client_key: bytes | None = None) -> None:
        self.user = user
        self.password = password
        self._client_key = client_key
        self._scram: ScramClient | None = None
        self._with_key = False  # this SCRAM login passes a client's key through
        self._server_signature: str | None = None  # what its SASLFinal must carry

    def _need_password(self) -> str:
        if self.password is None:
            raise BackendAuthError(
                f'the server asked for a password for user "{self.user}" and none is configured'
            )
        if secret_kind(self.password) == "scram":
            # A SCRAM secret proves a password to us; it cannot stand in for one.
            raise BackendAuthError(
                f'only a SCRAM secret is known for user "{self.user}", and a server login '
                "needs the password (or an md5 secret, for md5)"
            )
        return self.password

    def _passing_through(self) -> bool:
        """Whether this SCRAM login is made with a client's key (pass-through)."""
        if self.password is None or secret_kind(self.password) != "scram":
            return False
        if self._client_key is None:
            raise BackendAuthError(
                f'only a SCRAM secret is known for user "{self.user}", and no client has '
                "logged in with SCRAM yet to prove the key a server login needs"
            )
        return True

    def _pass_through_final(self, scram: ScramClient) -> str:
        """The client-final message from the client's key and the secret's
        ServerKey, and the ServerSignature to expect back."""
        assert self.password is not None and self._client_key is not None
        salt, stored_key, server_key, iterations = scram_auth_info(self.password)
        if bytes(scram.salt) != salt or int(scram.iterations) != iterations:
            raise BackendAuthError(
                f'the SCRAM secret known for user "{self.user}" is not the server\'s '
                "(its salt or iteration count differs)"
            )
        without_proof = f"c={base64.b64encode(bytes(scram.gs2_header)).decode()},r={scram.nonce}"
        auth_message = f"{scram.client_first_bare},{scram.server_first},{without_proof}"
        proof = _xor(self._client_key, _hmac(stored_key, auth_message))
        self._server_signature = base64.b64encode(_hmac(server_key, auth_message)).decode()
        return f"{without_proof},p={base64.b64encode(proof).decode()}"

    def respond(self, code: int, data: bytes) -> bytes | None:
        """The reply to an Authentication request, or None when nothing is sent."""
        if code == m.AUTH_OK or code == m.AUTH_SASL_FINAL and self._scram is None:
            return None
        if code == m.AUTH_CLEARTEXT:
            password = self._need_password()
            if secret_kind(password) == "md5":
                raise BackendAuthError(
                    f'the server asked for the password of user "{self.user}" in clear text, '
                    "and only an md5 secret is known"
                )
            return m.password_message(password.encode())
        if code == m.AUTH_MD5:
            password = self._need_password()
            secret = password if secret_kind(password) == "md5" else md5_secret(self.user, password)
            return m.password_message(md5_response(secret, data[:4]).encode())
        if code == m.AUTH_SASL:
            mechanisms = m.parse_sasl_mechanisms(data)
            if SCRAM_SHA_256 not in mechanisms:
                raise BackendAuthError(f"server offers no supported SASL mechanism: {mechanisms}")
            # (Passing through, scramp never sees a password: the final
            # message is made from the key instead.)
            self._with_key = self._passing_through()
            password = "" if self._with_key else self._need_password()
            self._scram = ScramClient([SCRAM_SHA_256], self.user, password)
            # Any count a server asks for, as libpq takes it (PostgreSQL 16's
            # scram_iterations may be below scramp's floor of 4096).
            self._scram.iterations = 1
            first = self._scram.get_client_first().encode()
            return m.sasl_initial_response(SCRAM_SHA_256, first)
        if code == m.AUTH_SASL_CONTINUE and self._scram is not None:
            try:
                self._scram.set_server_first(data.decode())
            except (ScramException, UnicodeDecodeError) as exc:
                raise BackendAuthError(f"server's SCRAM challenge is invalid: {exc}") from exc
            if self._with_key:
                return m.sasl_response(self._pass_through_final(self._scram).encode())
            return m.sasl_response(self._scram.get_client_final().encode())
        if code == m.AUTH_SASL_FINAL and self._scram is not None:
            expected = self._server_signature
            try:
                if expected is None:
                    self._scram.set_server_final(data.decode())
                elif not hmac.compare_digest(_attributes(data.decode()).get("v", ""), expected):
                    raise ScramException("The server signature doesn't match.")
            except ScramException as exc:
                raise BackendAuthError(f"server's SCRAM signature is invalid: {exc}") from exc
            return None
        raise BackendAuthError(f"unsupported authentication request {code} from the server")
