"""The admin API in-process: authorization, parameters, errors, the OpenAPI
document, and the ``admin`` client, with no PostgreSQL (an unstarted Proxy
and aiohttp's test server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from admin import (
    AdminClient,
    AdminHTTPError,
    AdminUnavailable,
    TailEvent,
    TailNotice,
    openapi_document,
    parse_target,
)
from scry.adminapi import AdminServer
from scry.config import Config
from scry.proxy import Proxy

SEED = {"listen_addr": "127.0.0.1:0", "database_url": "postgres://app:pw@127.0.0.1:1/app"}


def make_proxy(**admin: Any) -> Proxy:
    return Proxy(Config.model_validate({**SEED, "admin": admin}))


@pytest.fixture
async def api() -> AsyncIterator[Callable[..., Any]]:
    clients: list[TestClient[Any, Any]] = []

    async def make(**admin: Any) -> TestClient[Any, Any]:
        proxy = make_proxy(**admin)
        client: TestClient[Any, Any] = TestClient(TestServer(AdminServer(proxy).build_app()))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


BEARER = {"Authorization": "Bearer s3cret"}


async def test_reads_without_token_when_none_is_configured(api) -> None:
    client = await api()
    for path in ("/healthz", "/metrics", "/api/v1/status", "/api/v1/pools", "/api/v1/breaker"):
        response = await client.get(path)
        assert response.status == 200, path


async def test_actions_need_a_configured_token(api) -> None:
    client = await api()
    response = await client.post("/api/v1/breaker/reset")
    assert response.status == 403
    body = await response.json()
    assert body["code"] == "token_required" and "admin.token" in body["message"]


async def test_token_is_required_and_checked(api) -> None:
    client = await api(token="s3cret")
    assert (await client.get("/healthz")).status == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
        response = await client.get("/api/v1/status", headers=headers)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await response.json())["code"] == "unauthorized"
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/api/v1/status", headers=BEARER)).status == 200
    response = await client.post("/api/v1/breaker/trip?database=app", headers=BEARER)
    assert response.status == 200
    body = await response.json()
    assert body["changed"] == ["app"] and body["databases"][0]["breaker"]["state"] == "open"


async def test_metrics_public(api) -> None:
    client = await api(token="s3cret", metrics_public=True)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    assert (await client.get("/api/v1/status")).status == 401


async def test_read_only_refuses_actions(api) -> None:
    client = await api(token="s3cret", read_only=True)
    assert (await client.get("/api/v1/pins", headers=BEARER)).status == 200
    for path in ("/api/v1/breaker/trip", "/api/v1/reload", "/api/v1/clients/c1/kill"):
        response = await client.post(path, headers=BEARER)
        assert response.status == 403, path
        assert (await response.json())["code"] == "read_only"
    # The token is still checked first.
    assert (await client.post("/api/v1/breaker/trip")).status == 401


async def test_errors_are_json(api) -> None:
    client = await api(token="s3cret")
    cases = [
        ("GET", "/api/v1/nope", 404, "not_found"),
        ("GET", "/api/v1/queries/top?by=fastest", 400, "bad_parameter"),
        ("GET", "/api/v1/queries/top?window=-1", 400, "bad_parameter"),
        ("GET", "/api/v1/clients?limit=0", 400, "bad_parameter"),
        ("GET", "/api/v1/clients?offset=x", 400, "bad_parameter"),
        ("GET", "/api/v1/clients?limit=1_0", 400, "bad_parameter"),
        ("GET", "/api/v1/clients?limit=%D9%A1%D9%A2", 400, "bad_parameter"),  # Arabic-Indic 12
        ("GET", "/api/v1/queries/top?window=1_0", 400, "bad_parameter"),
        ("GET", "/api/v1/queries/top?window=infinity", 400, "bad_parameter"),
        ("POST", "/api/v1/clients/c999/kill", 404, "not_found"),
        ("POST", "/api/v1/pins/c999/unpin", 404, "not_found"),
        ("POST", "/api/v1/breaker/trip?database=other", 404, "not_found"),
        ("POST", "/api/v1/reload", 409, "no_config_file"),
        ("DELETE", "/api/v1/status", 405, "method_not_allowed"),
    ]
    for method, path, status, code in cases:
        response = await client.request(method, path, headers=BEARER)
        assert response.status == status, (method, path, await response.text())
        body = await response.json()
        assert body["code"] == code and body["message"], (method, path)


async def test_empty_listings_and_rankings(api) -> None:
    client = await api()
    assert await (await client.get("/api/v1/clients")).json() == {
        "total": 0,
        "offset": 0,
        "limit": 100,
        "clients": [],
    }
    assert (await (await client.get("/api/v1/pins")).json()) == {"pins": []}
    top = await (await client.get("/api/v1/queries/top?by=p99&limit=5&window=60")).json()
    assert top == {"by": "p99", "window_seconds": 60.0, "limit": 5, "queries": []}
    hot = await (await client.get("/debug/hot_data")).json()
    assert hot == {"tables": [], "values": []}
    status = await (await client.get("/api/v1/status")).json()
    assert status["pool_mode"] == "hybrid" and status["databases"] == ["app"]


async def test_openapi_is_served_and_refs_resolve(api) -> None:
    client = await api()
    document = await (await client.get("/api/v1/openapi.json")).json()
    assert document == json.loads(json.dumps(openapi_document(document["info"]["version"])))
    schemas = document["components"]["schemas"]

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if "$ref" in node else []
            return found + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(document):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    # Every route of the server is documented, and nothing else.
    routes = {
        r.resource.canonical  # type: ignore[union-attr]
        for r in AdminServer(make_proxy()).build_app().router.routes()
        if r.method != "HEAD"
    }
    assert routes == set(document["paths"])


# --- the client -------------------------------------------------------------------------


def test_parse_target() -> None:
    assert parse_target(None) == "http://127.0.0.1:6480"
    assert parse_target("db1:6480") == "http://db1:6480"
    assert parse_target("https://db1:6480/") == "https://db1:6480"
    for bad in ("ssh://db1/127.0.0.1:6480", "db1", "db1:port"):
        with pytest.raises(ValueError):
            parse_target(bad)


async def test_client_maps_errors_and_sends_the_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/kill"):
            return httpx.Response(404, json={"code": "not_found", "message": "no client 'c9'"})
        raise httpx.ConnectError("refused")

    async with AdminClient("h:1", token="tok", transport=httpx.MockTransport(handler)) as admin:
        with pytest.raises(AdminHTTPError) as caught:
            await admin.kill("c9")
        assert (caught.value.status, caught.value.code) == (404, "not_found")
        with pytest.raises(AdminUnavailable):
            await admin.status()
    assert seen[0].headers["Authorization"] == "Bearer tok"


async def test_client_tail_parses_events_and_notices() -> None:
    event = {
        "type": "query", "ts": 1.5, "worker": 0, "client_id": "c1", "database": "app",
        "user": "app", "application_name": "", "fingerprint": "00ff", "query": "select $1",
        "queue_us": 1, "pool_acquire_us": 2, "backend_us": 3, "total_us": 6, "rows": 1,
        "sqlstate": None, "pinned": False, "pin_reasons": [],
    }  # fmt: skip
    body = "\n".join(
        [json.dumps({"type": "heartbeat", "ts": 1.0, "dropped": 0}), json.dumps(event), ""]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.params["errors"] == "true" and request.url.params["min_ms"] == "5"
        return httpx.Response(200, text=body, headers={"Content-Type": "application/x-ndjson"})

    async with AdminClient("h:1", transport=httpx.MockTransport(handler)) as admin:
        items = [item async for item in admin.tail(errors=True, min_ms=5)]
    assert isinstance(items[0], TailNotice) and items[0].type == "heartbeat"
    assert isinstance(items[1], TailEvent) and items[1].query == "select $1"


# --- TLS ------------------------------------------------------------------------------------


def test_tls_needs_both_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        Config.model_validate({**SEED, "admin": {"tls_cert_file": str(tmp_path / "c.pem")}})


def _self_signed(tmp_path) -> tuple[str, str]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "admin.crt", tmp_path / "admin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


async def test_admin_over_tls_on_a_free_port(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    proxy = make_proxy(listen_addr="127.0.0.1:0", tls_cert_file=cert, tls_key_file=key)
    server = AdminServer(proxy)
    await server.start()
    try:
        assert server.tls and server.port > 0
        async with AdminClient(f"https://127.0.0.1:{server.port}", verify=cert) as admin:
            assert (await admin.healthz()).status == "ok"
            assert (await admin.status()).admin_addr == f"127.0.0.1:{server.port}"
        async with httpx.AsyncClient(verify=False) as plain:
            with pytest.raises(httpx.TransportError):
                await plain.get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        await server.stop()
