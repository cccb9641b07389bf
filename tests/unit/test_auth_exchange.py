"""Unit tests for scry.protocol.auth: both authentication exchanges, without I/O.

Both sides are sans-I/O, so they are wired together directly (as h11's tests
do with two connections): the bytes one side says to send are parsed and
handed to the other. The SCRAM client is built the way libpq does it, with an
empty user name in the client-first message (the server takes the user from
the StartupMessage), and is checked both with scramp and by hand from RFC 5802.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

import pytest
from scramp import ScramClient, ScramMechanism

from scry.protocol import messages as m
from scry.protocol.auth import (
    SCRAM_SHA_256,
    AuthStep,
    BackendAuthError,
    BackendAuthExchange,
    ClientAuthExchange,
    md5_response,
    md5_secret,
    scram_auth_info,
    secret_kind,
)
from scry.protocol.framing import MessageReader

USER = "alice"
PASSWORD = "correct horse"
ITERATIONS = 4096


def make_scram_secret(password: str, iterations: int = ITERATIONS) -> str:
    salt, stored, server, iters = ScramMechanism(SCRAM_SHA_256).make_auth_info(
        password, iteration_count=iterations
    )

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return f"SCRAM-SHA-256${iters}:{b64(salt)}${b64(stored)}:{b64(server)}"


SCRAM_SECRET = make_scram_secret(PASSWORD)
MD5_SECRET = md5_secret(USER, PASSWORD)

SECRETS = {"plain": PASSWORD, "md5": MD5_SECRET, "scram": SCRAM_SECRET}


def parse_one(data: bytes) -> tuple[int, bytes]:
    r = MessageReader()
    r.feed(data)
    msgs = r.messages()
    assert len(msgs) == 1, msgs
    assert r.buffered == 0
    return msgs[0]


def auth_request(step: AuthStep) -> tuple[int, bytes]:
    """The (code, data) of the Authentication request a step sends to the client."""
    kind, body = parse_one(step.reply)
    assert kind == ord("R")
    return m.parse_auth_request(body)


def failed(step: AuthStep, sqlstate: str = "28P01") -> bool:
    return step.error is not None and step.error[0] == sqlstate and not step.done


# --- a libpq-style SCRAM client, by hand (RFC 5802 / RFC 7677) ----------------------


class HandScramClient:
    """SCRAM-SHA-256 client written from RFC 5802, sending an empty user name as libpq does."""

    def __init__(self, password: str) -> None:
        self.password = password
        self.c_nonce = base64.b64encode(os.urandom(18)).decode()
        self.client_first_bare = f"n=,r={self.c_nonce}"

    def client_first(self) -> str:
        return "n,," + self.client_first_bare

    def client_final(self, server_first: str) -> str:
        attrs = dict(part.split("=", 1) for part in server_first.split(","))
        nonce, salt, iterations = attrs["r"], base64.b64decode(attrs["s"]), int(attrs["i"])
        assert nonce.startswith(self.c_nonce) and len(nonce) > len(self.c_nonce)
        salted = hashlib.pbkdf2_hmac("sha256", self.password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        stored_key = hashlib.sha256(client_key).digest()
        without_proof = f"c={base64.b64encode(b'n,,').decode()},r={nonce}"
        auth_message = f"{self.client_first_bare},{server_first},{without_proof}".encode()
        client_sig = hmac.digest(stored_key, auth_message, "sha256")
        proof = bytes(a ^ b for a, b in zip(client_key, client_sig, strict=True))
        server_key = hmac.digest(salted, b"Server Key", "sha256")
        self.expected_server_final = (
            "v=" + base64.b64encode(hmac.digest(server_key, auth_message, "sha256")).decode()
        )
        return f"{without_proof},p={base64.b64encode(proof).decode()}"


class ScrampEmptyUserClient:
    """scramp's client with an empty user name (what libpq puts in client-first)."""

    def __init__(self, password: str) -> None:
        self._c = ScramClient([SCRAM_SHA_256], "", password)

    def client_first(self) -> str:
        first = self._c.get_client_first()
        # exactly what libpq sends: no authzid, empty user name
        assert first.startswith("n,,n=,r=")
        return first

    def client_final(self, server_first: str) -> str:
        self._c.set_server_first(server_first)
        return self._c.get_client_final()

    def check_server_final(self, server_final: str) -> None:
        self._c.set_server_final(server_final)


SCRAM_CLIENTS = [HandScramClient, ScrampEmptyUserClient]


def scram_login(
    server: ClientAuthExchange, client: HandScramClient | ScrampEmptyUserClient
) -> tuple[AuthStep, str | None]:
    """Run a SCRAM exchange; return the last step and the server-first message (if any)."""
    code, data = auth_request(server.start())
    assert code == m.AUTH_SASL
    assert m.parse_sasl_mechanisms(data) == [SCRAM_SHA_256]
    kind, body = parse_one(m.sasl_initial_response(SCRAM_SHA_256, client.client_first().encode()))
    step = server.handle(kind, body)
    if step.error is not None:
        return step, None
    assert not step.done
    code, data = auth_request(step)
    assert code == m.AUTH_SASL_CONTINUE
    server_first = data.decode()
    kind, body = parse_one(m.sasl_response(client.client_final(server_first).encode()))
    return server.handle(kind, body), server_first


# --- helpers --------------------------------------------------------------------------


def test_md5_secret_known_value() -> None:
    # PostgreSQL: SELECT 'md5' || md5('postgres' || 'postgres')
    assert md5_secret("postgres", "postgres") == "md53175bce1d3201d16594cebf9d7eb3f9d"


def test_md5_response() -> None:
    salt = b"\x01\x02\x03\x04"
    inner = hashlib.md5(b"pwuser").hexdigest()
    expected = "md5" + hashlib.md5(inner.encode() + salt).hexdigest()
    assert md5_response(md5_secret("user", "pw"), salt) == expected


@pytest.mark.parametrize(
    ("secret", "kind"),
    [
        (PASSWORD, "plain"),
        ("", "plain"),
        (MD5_SECRET, "md5"),
        ("md5" + "z" * 32, "plain"),  # not hex
        ("md5" + "0" * 31, "plain"),  # too short
        (SCRAM_SECRET, "scram"),
        ("SCRAM-SHA-256", "plain"),
    ],
)
def test_secret_kind(secret: str, kind: str) -> None:
    assert secret_kind(secret) == kind


def test_scram_auth_info_parses_secret() -> None:
    salt, stored, server, iterations = scram_auth_info(make_scram_secret("pw", 5000))
    assert iterations == 5000
    _, stored2, server2, _ = ScramMechanism(SCRAM_SHA_256).make_auth_info("pw", 5000, salt)
    assert (stored, server) == (stored2, server2)


# --- ClientAuthExchange: SCRAM -------------------------------------------------------------


@pytest.mark.parametrize("client_cls", SCRAM_CLIENTS)
@pytest.mark.parametrize("secret", [PASSWORD, SCRAM_SECRET], ids=["plain", "scram"])
def test_scram_success(client_cls: type, secret: str) -> None:
    server = ClientAuthExchange("scram-sha-256", USER, secret)
    client = client_cls(PASSWORD)
    step, server_first = scram_login(server, client)
    assert step.error is None and step.done
    code, data = auth_request(step)
    assert code == m.AUTH_SASL_FINAL
    server_final = data.decode()
    if isinstance(client, HandScramClient):
        assert server_final == client.expected_server_final
    else:
        client.check_server_final(server_final)  # raises if the server signature is wrong
    assert server_first is not None
    assert f"i={ITERATIONS}" in server_first.split(",")


def test_scram_uses_stored_salt_and_iterations() -> None:
    secret = make_scram_secret(PASSWORD, 7777)
    salt = scram_auth_info(secret)[0]
    server = ClientAuthExchange("scram-sha-256", USER, secret)
    step, server_first = scram_login(server, HandScramClient(PASSWORD))
    assert step.done
    assert server_first is not None
    attrs = dict(p.split("=", 1) for p in server_first.split(","))
    assert base64.b64decode(attrs["s"]) == salt
    assert attrs["i"] == "7777"


@pytest.mark.parametrize("client_cls", SCRAM_CLIENTS)
def test_scram_iterations_for_a_plaintext_secret(client_cls: type) -> None:
    # (PgBouncer's scram_iterations: the rounds of secrets made from passwords.)
    for user, secret in ((USER, PASSWORD), ("nobody", None)):  # unknown users alike
        server = ClientAuthExchange("scram-sha-256", user, secret, scram_iterations=5000)
        step, server_first = scram_login(server, client_cls(PASSWORD))
        assert server_first is not None and "i=5000" in server_first.split(",")
        assert step.done is (secret is not None)
    # A stored SCRAM secret keeps its own count.
    server = ClientAuthExchange("scram-sha-256", USER, SCRAM_SECRET, scram_iterations=5000)
    _, server_first = scram_login(server, client_cls(PASSWORD))
    assert server_first is not None and f"i={ITERATIONS}" in server_first.split(",")


@pytest.mark.parametrize("client_cls", SCRAM_CLIENTS)
@pytest.mark.parametrize("secret", [PASSWORD, SCRAM_SECRET], ids=["plain", "scram"])
def test_scram_wrong_password(client_cls: type, secret: str) -> None:
    server = ClientAuthExchange("scram-sha-256", USER, secret)
    step, server_first = scram_login(server, client_cls("wrong"))
    assert server_first is not None  # the exchange reached the final message
    assert failed(step)
    assert step.reply == b""
    assert step.error is not None and USER in step.error[1]


@pytest.mark.parametrize("client_cls", SCRAM_CLIENTS)
def test_scram_unknown_user_runs_exchange_then_fails(client_cls: type) -> None:
    server = ClientAuthExchange("scram-sha-256", "nobody", None)
    step, server_first = scram_login(server, client_cls(PASSWORD))
    assert server_first is not None  # looks like a real user until the very end
    assert server_first.startswith("r=")
    assert failed(step)


def test_scram_user_name_in_client_first_is_ignored() -> None:
    """As in PostgreSQL, the user comes from the StartupMessage, not the SCRAM message."""

    class NamedClient(ScrampEmptyUserClient):
        def __init__(self, password: str) -> None:
            self._c = ScramClient([SCRAM_SHA_256], "mallory", password)

        def client_first(self) -> str:
            return self._c.get_client_first()

    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    step, _ = scram_login(server, NamedClient(PASSWORD))
    assert step.done


def test_md5_method_with_scram_secret_asks_for_scram() -> None:
    server = ClientAuthExchange("md5", USER, SCRAM_SECRET)
    assert server.method == "scram-sha-256"
    step, _ = scram_login(server, HandScramClient(PASSWORD))
    assert step.done


def test_scram_method_with_md5_secret_asks_for_md5() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, MD5_SECRET)
    assert server.method == "md5"
    code, _ = auth_request(server.start())
    assert code == m.AUTH_MD5


def test_scram_unsupported_mechanism() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    server.start()
    kind, body = parse_one(m.sasl_initial_response("SCRAM-SHA-256-PLUS", b"p=tls-server-end-point"))
    assert failed(server.handle(kind, body), "08P01")


def test_scram_client_final_not_utf8() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    server.start()
    client = HandScramClient(PASSWORD)
    kind, body = parse_one(m.sasl_initial_response(SCRAM_SHA_256, client.client_first().encode()))
    assert server.handle(kind, body).error is None
    assert failed(server.handle(ord("p"), b"\xff\xfe"), "08P01")


def test_scram_initial_response_without_mechanism_terminator() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    server.start()
    assert failed(server.handle(ord("p"), b"SCRAM-SHA-256"), "08P01")


@pytest.mark.parametrize(
    "body", [b"SCRAM-SHA-256\x00", b"SCRAM-SHA-256\x00\x00\x00"], ids=["no-length", "short"]
)
def test_scram_truncated_initial_response_is_protocol_violation(body: bytes) -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    server.start()
    assert failed(server.handle(ord("p"), body), "08P01")


def test_scram_garbage_client_first_fails() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    server.start()
    kind, body = parse_one(m.sasl_initial_response(SCRAM_SHA_256, b"garbage"))
    step = server.handle(kind, body)
    assert step.error is not None and not step.done


def test_scram_tampered_nonce_fails() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    client = HandScramClient(PASSWORD)
    server.start()
    kind, body = parse_one(m.sasl_initial_response(SCRAM_SHA_256, client.client_first().encode()))
    _, data = auth_request(server.handle(kind, body))
    final = client.client_final(data.decode())
    tampered = final.replace(",r=", ",r=X", 1)
    assert failed(server.handle(ord("p"), tampered.encode()))


# --- ClientAuthExchange: md5, cleartext, trust ------------------------------------------


def md5_login(server: ClientAuthExchange, user: str, password: str) -> AuthStep:
    code, salt = auth_request(server.start())
    assert code == m.AUTH_MD5
    assert len(salt) == 4
    answer = md5_response(md5_secret(user, password), salt)
    kind, body = parse_one(m.password_message(answer.encode()))
    return server.handle(kind, body)


@pytest.mark.parametrize("secret", [PASSWORD, MD5_SECRET], ids=["plain", "md5"])
def test_md5_success(secret: str) -> None:
    step = md5_login(ClientAuthExchange("md5", USER, secret), USER, PASSWORD)
    assert step == AuthStep(done=True)


@pytest.mark.parametrize("secret", [PASSWORD, MD5_SECRET], ids=["plain", "md5"])
def test_md5_wrong_password(secret: str) -> None:
    assert failed(md5_login(ClientAuthExchange("md5", USER, secret), USER, "nope"))


def test_md5_salted_with_user_name() -> None:
    # the md5 secret depends on the user: a right password under another name fails
    assert failed(md5_login(ClientAuthExchange("md5", USER, PASSWORD), "bob", PASSWORD))


def test_md5_unknown_user() -> None:
    assert failed(md5_login(ClientAuthExchange("md5", "nobody", None), "nobody", PASSWORD))


def test_md5_salt_is_random() -> None:
    salts = {auth_request(ClientAuthExchange("md5", USER, PASSWORD).start())[1] for _ in range(8)}
    assert len(salts) > 1


def plain_login(server: ClientAuthExchange, password: str) -> AuthStep:
    code, _ = auth_request(server.start())
    assert code == m.AUTH_CLEARTEXT
    kind, body = parse_one(m.password_message(password.encode()))
    return server.handle(kind, body)


@pytest.mark.parametrize("kind", ["plain", "md5", "scram"])
def test_cleartext_success(kind: str) -> None:
    step = plain_login(ClientAuthExchange("plain", USER, SECRETS[kind]), PASSWORD)
    assert step == AuthStep(done=True)


@pytest.mark.parametrize("kind", ["plain", "md5", "scram"])
def test_cleartext_wrong_password(kind: str) -> None:
    assert failed(plain_login(ClientAuthExchange("plain", USER, SECRETS[kind]), "nope"))


def test_cleartext_unknown_user() -> None:
    assert failed(plain_login(ClientAuthExchange("plain", "nobody", None), PASSWORD))


@pytest.mark.parametrize("method", ["trust", "any"])
def test_trust(method: str) -> None:
    assert ClientAuthExchange(method, USER, None).start() == AuthStep(done=True)


def test_unsupported_method() -> None:
    step = ClientAuthExchange("gss", USER, PASSWORD).start()
    assert failed(step, "28000")


@pytest.mark.parametrize("method", ["plain", "md5", "scram-sha-256"])
def test_non_password_message_is_protocol_violation(method: str) -> None:
    server = ClientAuthExchange(method, USER, PASSWORD)
    server.start()
    kind, body = parse_one(m.query("select 1"))
    assert failed(server.handle(kind, body), "08P01")


# --- BackendAuthExchange against ClientAuthExchange ----------------------------------------


def wire(
    server: ClientAuthExchange, backend: BackendAuthExchange, tamper=None
) -> tuple[str, object]:
    """Drive ``backend`` (scry as a client) against ``server`` (playing PostgreSQL).

    Returns ("ok", requests seen) or ("error", sqlstate).
    ``tamper`` may rewrite the server's Authentication request (code, data).
    """
    seen: list[int] = []
    step = server.start()
    for _ in range(10):
        if step.error is not None:
            return "error", step.error[0]
        if step.reply:
            code, data = auth_request(step)
            if tamper is not None:
                code, data = tamper(code, data)
            seen.append(code)
            answer = backend.respond(code, data)
        else:
            answer = None
        if step.done:
            assert answer is None  # nothing to send after SASLFinal
            assert backend.respond(m.AUTH_OK, b"") is None
            seen.append(m.AUTH_OK)
            return "ok", seen
        assert answer is not None
        step = server.handle(*parse_one(answer))
    raise AssertionError("exchange did not finish")


@pytest.mark.parametrize("kind", ["plain", "md5"])
def test_backend_md5(kind: str) -> None:
    result = wire(
        ClientAuthExchange("md5", USER, SECRETS[kind]), BackendAuthExchange(USER, PASSWORD)
    )
    assert result == ("ok", [m.AUTH_MD5, m.AUTH_OK])


def test_backend_md5_from_md5_secret() -> None:
    # a database_url may carry the md5 secret instead of the password
    result = wire(ClientAuthExchange("md5", USER, PASSWORD), BackendAuthExchange(USER, MD5_SECRET))
    assert result == ("ok", [m.AUTH_MD5, m.AUTH_OK])


@pytest.mark.parametrize("kind", ["plain", "scram"])
def test_backend_scram(kind: str) -> None:
    result = wire(
        ClientAuthExchange("scram-sha-256", USER, SECRETS[kind]),
        BackendAuthExchange(USER, PASSWORD),
    )
    assert result == ("ok", [m.AUTH_SASL, m.AUTH_SASL_CONTINUE, m.AUTH_SASL_FINAL, m.AUTH_OK])


def hand_scram_secret(password: str, iterations: int) -> str:
    """A SCRAM secret by hand (RFC 5802), for counts below scramp's floor of 4096."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    stored = hashlib.sha256(client_key).digest()
    server = hmac.digest(salted, b"Server Key", "sha256")

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored)}:{b64(server)}"


def test_backend_scram_takes_any_count_the_server_asks_for() -> None:
    # PostgreSQL 16's scram_iterations may store fewer than 4096 rounds; libpq
    # logs in all the same, and so must scry.
    server = ClientAuthExchange("scram-sha-256", USER, hand_scram_secret(PASSWORD, 1024))
    result = wire(server, BackendAuthExchange(USER, PASSWORD))
    assert result == ("ok", [m.AUTH_SASL, m.AUTH_SASL_CONTINUE, m.AUTH_SASL_FINAL, m.AUTH_OK])


def test_backend_refuses_a_bad_scram_challenge_with_a_clear_error() -> None:
    def foreign_nonce(code: int, data: bytes) -> tuple[int, bytes]:
        if code == m.AUTH_SASL_CONTINUE:
            return code, b"r=someone-elses-nonce," + data.split(b",", 1)[1]
        return code, data

    server = ClientAuthExchange("scram-sha-256", USER, PASSWORD)
    with pytest.raises(BackendAuthError, match="server's SCRAM challenge is invalid"):
        wire(server, BackendAuthExchange(USER, PASSWORD), tamper=foreign_nonce)


def test_backend_scram_empty_user_name() -> None:
    result = wire(
        ClientAuthExchange("scram-sha-256", USER, PASSWORD), BackendAuthExchange("", PASSWORD)
    )
    assert result[0] == "ok"


@pytest.mark.parametrize("kind", ["plain", "md5", "scram"])
def test_backend_cleartext(kind: str) -> None:
    result = wire(
        ClientAuthExchange("plain", USER, SECRETS[kind]), BackendAuthExchange(USER, PASSWORD)
    )
    assert result == ("ok", [m.AUTH_CLEARTEXT, m.AUTH_OK])


@pytest.mark.parametrize("method", ["md5", "scram-sha-256", "plain"])
def test_backend_refuses_to_log_in_with_a_scram_secret_alone(method: str) -> None:
    # A looked-up SCRAM secret cannot stand in for the password: said plainly,
    # before anything derived from it goes to the server.
    server = ClientAuthExchange(method, USER, PASSWORD)
    with pytest.raises(BackendAuthError, match='only a SCRAM secret is known for user "alice"'):
        wire(server, BackendAuthExchange(USER, SECRETS["scram"]))


# --- SCRAM pass-through: a client's proven key logs scry in ---------------------------------


def client_key_of(password: str, secret: str) -> bytes:
    """RFC 5802's ClientKey for ``password`` under ``secret``'s salt and iterations."""
    salt, _, _, iterations = scram_auth_info(secret)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return hmac.digest(salted, b"Client Key", "sha256")


def proven_key(secret: str, password: str = PASSWORD, client_cls: type = HandScramClient):
    server = ClientAuthExchange("scram-sha-256", USER, secret)
    step, _ = scram_login(server, client_cls(password))
    return step, server.client_key


@pytest.mark.parametrize("client_cls", SCRAM_CLIENTS)
def test_a_scram_login_against_a_scram_secret_yields_the_client_key(client_cls: type) -> None:
    step, key = proven_key(SCRAM_SECRET, client_cls=client_cls)
    assert step.done and key == client_key_of(PASSWORD, SCRAM_SECRET)


@pytest.mark.parametrize(
    ("secret", "password"), [(SCRAM_SECRET, "wrong"), (PASSWORD, PASSWORD)], ids=["wrong", "plain"]
)
def test_no_key_from_a_failed_login_or_a_plaintext_secret(secret: str, password: str) -> None:
    # (A plaintext secret logs servers in itself; a failed proof proves nothing.)
    assert proven_key(secret, password)[1] is None


def test_backend_passes_a_proven_key_through_to_a_server_with_the_same_secret() -> None:
    _, key = proven_key(SCRAM_SECRET)
    result = wire(
        ClientAuthExchange("scram-sha-256", USER, SCRAM_SECRET),  # PostgreSQL, same pg_authid
        BackendAuthExchange(USER, SCRAM_SECRET, key),
    )
    assert result == ("ok", [m.AUTH_SASL, m.AUTH_SASL_CONTINUE, m.AUTH_SASL_FINAL, m.AUTH_OK])


def test_a_wrong_key_is_refused_by_the_server() -> None:
    backend = BackendAuthExchange(USER, SCRAM_SECRET, client_key_of("wrong", SCRAM_SECRET))
    assert wire(ClientAuthExchange("scram-sha-256", USER, SCRAM_SECRET), backend) == (
        "error",
        "28P01",
    )


def test_a_server_with_another_secret_for_the_password_is_named() -> None:
    # Same password, new salt (ALTER ROLE ... PASSWORD again): the key is no use.
    server = ClientAuthExchange("scram-sha-256", USER, make_scram_secret(PASSWORD))
    backend = BackendAuthExchange(USER, SCRAM_SECRET, proven_key(SCRAM_SECRET)[1])
    with pytest.raises(BackendAuthError, match="is not the server's"):
        wire(server, backend)


def test_a_pass_through_checks_the_server_signature() -> None:
    def forge(code: int, data: bytes) -> tuple[int, bytes]:
        if code == m.AUTH_SASL_FINAL:
            return code, b"v=" + base64.b64encode(os.urandom(32))
        return code, data

    backend = BackendAuthExchange(USER, SCRAM_SECRET, proven_key(SCRAM_SECRET)[1])
    server = ClientAuthExchange("scram-sha-256", USER, SCRAM_SECRET)
    with pytest.raises(BackendAuthError, match="signature is invalid"):
        wire(server, backend, tamper=forge)


def test_an_md5_server_is_not_answered_with_a_scram_key() -> None:
    backend = BackendAuthExchange(USER, SCRAM_SECRET, proven_key(SCRAM_SECRET)[1])
    with pytest.raises(BackendAuthError, match="only a SCRAM secret is known"):
        wire(ClientAuthExchange("md5", USER, PASSWORD), backend)


def test_without_a_key_the_scram_refusal_says_what_is_missing() -> None:
    server = ClientAuthExchange("scram-sha-256", USER, SCRAM_SECRET)
    with pytest.raises(BackendAuthError, match="no client has logged in with SCRAM"):
        wire(server, BackendAuthExchange(USER, SCRAM_SECRET))


def test_backend_cleartext_is_not_answered_with_an_md5_secret() -> None:
    server = ClientAuthExchange("plain", USER, PASSWORD)
    with pytest.raises(BackendAuthError, match="only an md5 secret is known"):
        wire(server, BackendAuthExchange(USER, MD5_SECRET))


def test_backend_trust_needs_no_password() -> None:
    assert wire(ClientAuthExchange("trust", USER, None), BackendAuthExchange(USER, None)) == (
        "ok",
        [m.AUTH_OK],
    )


@pytest.mark.parametrize(
    ("method", "kind"),
    [("md5", "plain"), ("md5", "md5"), ("scram-sha-256", "plain"), ("scram-sha-256", "scram"),
     ("plain", "plain")],
)  # fmt: skip
def test_backend_wrong_password(method: str, kind: str) -> None:
    result = wire(ClientAuthExchange(method, USER, SECRETS[kind]), BackendAuthExchange(USER, "no"))
    assert result == ("error", "28P01")


@pytest.mark.parametrize("method", ["plain", "md5", "scram-sha-256"])
def test_backend_no_password_configured(method: str) -> None:
    with pytest.raises(BackendAuthError, match="none is configured"):
        wire(ClientAuthExchange(method, USER, PASSWORD), BackendAuthExchange(USER, None))


def test_backend_rejects_bad_server_signature() -> None:
    def tamper(code: int, data: bytes) -> tuple[int, bytes]:
        if code == m.AUTH_SASL_FINAL:
            return code, b"v=" + base64.b64encode(b"\x00" * 32)
        return code, data

    with pytest.raises(BackendAuthError, match="signature"):
        wire(
            ClientAuthExchange("scram-sha-256", USER, PASSWORD),
            BackendAuthExchange(USER, PASSWORD),
            tamper,
        )


def test_backend_no_supported_sasl_mechanism() -> None:
    backend = BackendAuthExchange(USER, PASSWORD)
    with pytest.raises(BackendAuthError, match="no supported SASL mechanism"):
        backend.respond(m.AUTH_SASL, b"SCRAM-SHA-256-PLUS\x00\x00")


def test_backend_picks_scram_among_mechanisms() -> None:
    backend = BackendAuthExchange(USER, PASSWORD)
    reply = backend.respond(m.AUTH_SASL, b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00\x00")
    assert reply is not None
    kind, body = parse_one(reply)
    mechanism, first = m.parse_sasl_initial_response(body)
    assert kind == ord("p") and mechanism == SCRAM_SHA_256
    assert first.startswith(b"n,,n=")


@pytest.mark.parametrize("code", [2, 7, 8, 9, 99])
def test_backend_unsupported_request(code: int) -> None:
    with pytest.raises(BackendAuthError, match="unsupported authentication request"):
        BackendAuthExchange(USER, PASSWORD).respond(code, b"")


def test_backend_sasl_continue_without_sasl() -> None:
    with pytest.raises(BackendAuthError):
        BackendAuthExchange(USER, PASSWORD).respond(m.AUTH_SASL_CONTINUE, b"r=x,s=eA==,i=4096")


def test_backend_cleartext_reply_bytes() -> None:
    assert BackendAuthExchange(USER, "pw").respond(m.AUTH_CLEARTEXT, b"") == m.password_message(
        b"pw"
    )
