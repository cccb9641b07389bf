"""Payloads of the admin protocol (``/api/v1``), as pydantic models.

The proxy builds every JSON response from these models and generates its
OpenAPI document from them (``openapi_document``), so the document, the
server and the client cannot drift apart. Field names are part of the
contract (docs/admin-api.md): add fields, never rename them.

Times: ``*_at`` and ``since`` are Unix epoch seconds (float); ``*_s`` are
durations in seconds; ``*_ms`` / ``*_us`` are milli-/microseconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

API_PREFIX = "/api/v1"

#: Rankings accepted by ``GET /api/v1/queries/top?by=``.
RANKINGS = ("total_time", "mean", "calls", "errors", "p99")

#: Reasons a session pins its server (hybrid mode).
PIN_REASONS = ("set", "prepare", "temp_table", "cursor", "advisory_lock", "listen", "load")


class Payload(BaseModel):
    """Base of every payload: unknown fields are ignored by clients (forward compatible)."""

    model_config = ConfigDict(extra="ignore")


def _is_none(value: Any) -> bool:
    return value is None


def _fleet_field(description: str) -> Any:
    """An optional field that only an instance with several workers fills in
    (left out of the JSON when unset, so a single process answers as before)."""
    return Field(None, exclude_if=_is_none, description=description)


# --------------------------------------------------------------------------- #
# Workers (``scry serve --workers N``)
# --------------------------------------------------------------------------- #


class WorkerMissing(Payload):
    worker: int
    error: str = Field(description="timeout, or why the worker could not be asked.")


class FleetInfo(Payload):
    """Which workers an answer covers; present when the instance runs several."""

    scope: Literal["instance", "worker"] = Field(
        description="instance: merged over every worker; worker: one worker's (?worker=N)."
    )
    workers: int = Field(description="Worker processes of the instance.")
    answered: list[int] = Field(description="Workers whose figures are in this answer.")
    missing: list[WorkerMissing] = Field(
        description="Workers that did not answer in time (their figures are missing)."
    )


_FLEET = "Workers this answer covers (only with several workers)."
_WORKER = "The worker process this row belongs to (only with several workers)."


# --------------------------------------------------------------------------- #
# Errors and liveness
# --------------------------------------------------------------------------- #


class ErrorResponse(Payload):
    """Every non-2xx answer: a machine-readable code and a sentence for people."""

    code: str = Field(description="Stable error code, e.g. not_found, unauthorized, read_only.")
    message: str


class Health(Payload):
    status: Literal["ok"] = "ok"
    draining: bool = False


# --------------------------------------------------------------------------- #
# Status
# --------------------------------------------------------------------------- #


class QueryTotals(Payload):
    """What the observatory has counted (``Observatory.stats_summary``)."""

    queries: int = 0
    errors: int = 0
    rows: int = 0
    total_ms: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    window_seconds: float = 0.0
    window_queries: int = 0
    window_errors: int = 0
    qps: float = 0.0
    window_p99_ms: float = 0.0
    fingerprints: int = 0
    evicted_fingerprints: int = 0
    events_dropped: int = 0
    events_lost: int = 0
    tail_events_dropped: int = 0
    records_dropped: int = 0
    records_pending: int = 0
    shapes_parsed: int = 0
    anonymize: bool = True
    anonymize_key_random: bool = False


class Status(Payload):
    version: str
    pid: int
    started_at: float
    uptime_s: float
    pool_mode: str
    workers: int = Field(description="Worker processes answering for this instance.")
    worker: int = Field(0, description="The worker that answered (0-based).")
    listen_addr: str
    listen_addresses: list[str] = Field(description="Addresses the proxy listens on for clients.")
    admin_addr: str
    databases: list[str]
    draining: bool
    paused: bool
    read_only: bool
    clients: int
    servers: int
    pools: int
    waiting: int
    pinned: int = Field(description="Servers held by pinned sessions.")
    queries: QueryTotals
    per_worker: list[Status] | None = _fleet_field(
        "Each worker's own status (instance scope only); the fields above are totals."
    )
    fleet: FleetInfo | None = _fleet_field(_FLEET)


# --------------------------------------------------------------------------- #
# Pools, clients, servers
# --------------------------------------------------------------------------- #


class PoolTotals(Payload):
    waits: int = Field(description="Clients that had to queue for a server, ever.")
    wait_ms_total: float
    wait_ms_mean: float
    servers_opened: int
    servers_closed: int


class PoolInfo(Payload):
    database: str
    user: str
    mode: str
    size: int
    min_size: int
    reserve_size: int = Field(
        0, description="Servers allowed beyond size for clients queued past reserve_pool_timeout."
    )
    reserve_in_use: int = Field(0, description="Servers open (or opening) beyond size now.")
    servers: int = Field(description="Logged-in server connections.")
    connecting: int
    active: int = Field(description="Servers running something for a client.")
    idle: int = Field(description="Servers free to hand out: idle in the pool plus parked.")
    parked: int = Field(description="Servers kept by a client between transactions (in idle).")
    waiting: int = Field(description="Clients queued for a server.")
    max_wait_ms: float = Field(description="How long the oldest waiting client has waited.")
    pinned: int = Field(description="Servers held by pinned sessions.")
    stale: bool
    breaker: str = Field(description="State of the database's circuit breaker.")
    last_error: str | None
    totals: PoolTotals
    workers: list[int] | None = _fleet_field("Workers that have this pool (summed above).")


class PoolList(Payload):
    pools: list[PoolInfo]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class ClientInfo(Payload):
    id: str
    addr: str
    user: str
    database: str
    application_name: str
    state: str = Field(description="startup, auth, login, ready, waiting, active, idle or closed.")
    connected_at: float
    server_id: str | None
    backend_pid: int | None
    parked: bool
    waiting: bool
    wait_ms: float | None
    idle_s: float | None = Field(description="Seconds since the client last sent something.")
    pinned: bool
    pin_reasons: list[str]
    fingerprint: str | None = Field(description="Fingerprint of the statement running now.")
    query: str | None = Field(
        description="Normalized (anonymized) text of the statement running now."
    )
    running_ms: float | None
    worker: int | None = _fleet_field(_WORKER)


class ClientList(Payload):
    total: int
    offset: int
    limit: int
    clients: list[ClientInfo]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class ServerInfo(Payload):
    id: str
    database: str
    user: str
    state: str
    client_id: str | None
    backend_pid: int
    local_addr: str
    addr: str = Field(
        "",
        description="The server's ip:port or socket directory (of a host list, the one it took).",
    )
    created_at: float
    age_s: float
    idle_s: float | None
    pending: int = Field(description="ReadyForQuery messages owed to the linked client.")
    tx_status: str = Field(description="I idle, T in a transaction, E in a failed transaction.")
    pinned: bool
    retire: bool
    worker: int | None = _fleet_field(_WORKER)


class ServerList(Payload):
    total: int
    offset: int
    limit: int
    servers: list[ServerInfo]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


# --------------------------------------------------------------------------- #
# Pins
# --------------------------------------------------------------------------- #


class PinInfo(Payload):
    client_id: str
    server_id: str | None = Field(
        description="None while the server was reclaimed (replay pending)."
    )
    backend_pid: int | None
    database: str
    user: str
    application_name: str
    reasons: list[str]
    replayable: bool
    since: float | None
    pinned_s: float | None
    holding_server: bool
    replay_pending: bool
    counts: dict[str, int]
    settings: list[str] = Field(description="Names of the settings the session changed.")
    statements: list[str] = Field(description="Replayable statements, anonymized.")
    pinned_by: dict[str, str] = Field(
        description="Per reason, the (anonymized) statement that first pinned it."
    )
    worker: int | None = _fleet_field(_WORKER)


class PinList(Payload):
    pins: list[PinInfo]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class UnpinResult(Payload):
    client_id: str
    unpinned: bool
    replayed: list[str] = Field(default_factory=list)
    lost: list[str] = Field(default_factory=list)
    disconnected: bool = False
    reason: str | None = None
    worker: int | None = _fleet_field(_WORKER)


# --------------------------------------------------------------------------- #
# Breaker and health
# --------------------------------------------------------------------------- #


class BreakerConfigInfo(Payload):
    failure_threshold: int
    success_threshold: int
    timeout_seconds: float
    half_open_max_probes: int


class BreakerCounters(Payload):
    failures: int
    successes: int
    rejections: int
    consecutive_failures: int
    opened: int


class HalfOpenInfo(Payload):
    probes_in_flight: int
    probe_successes: int


class BreakerTransition(Payload):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    at: float
    seconds_ago: float
    from_: str = Field(alias="from")
    to: str
    reason: str
    worker: int | None = _fleet_field("The worker whose breaker changed (instance scope only).")


class BreakerSnapshot(Payload):
    name: str
    state: Literal["closed", "open", "half_open"]
    enabled: bool
    held: bool
    open_reason: str | None
    #: Opened because PostgreSQL was gone: a server login tried every second
    #: moves it to half-open as soon as one succeeds.
    ends_on_login: bool = False
    retry_in_seconds: float | None
    config: BreakerConfigInfo
    counters: BreakerCounters
    last_failure_reason: str | None
    half_open: HalfOpenInfo
    transitions: list[BreakerTransition]


class HealthWindow(Payload):
    queries: int | None = None
    errors: int | None = None
    qps: float | None = None
    error_rate: float | None = None
    p50: float | None = None
    p99: float | None = None
    wait_mean: float | None = None
    wait_max: float | None = None


class HealthPool(Payload):
    saturation: float
    waiting: int
    oldest_wait_seconds: float


class HealthBaseline(Payload):
    p50: float | None
    p99: float | None
    error_rate: float | None
    ready: bool


class HealthSignal(Payload):
    name: str
    severity: str
    value: float
    threshold: float
    for_seconds: float
    message: str
    worker: int | None = _fleet_field("The worker whose monitor raised it (instance scope only).")


class HealthSnapshot(Payload):
    name: str
    window_seconds: int
    window: HealthWindow
    pool: HealthPool
    baseline: HealthBaseline
    signals: list[HealthSignal]


class WorkerBreaker(Payload):
    """One worker's breaker and health monitor of a database."""

    worker: int
    breaker: BreakerSnapshot
    health: HealthSnapshot


class BreakerEntry(Payload):
    database: str
    breaker: BreakerSnapshot
    health: HealthSnapshot
    workers: list[WorkerBreaker] | None = _fleet_field(
        "Each worker's own breaker and monitor (instance scope only); the fields above "
        "merge them (docs/admin-api.md, Workers)."
    )


class BreakerList(Payload):
    databases: list[BreakerEntry]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class BreakerActionResult(Payload):
    action: Literal["trip", "reset"]
    changed: list[str] = Field(description="Databases whose breaker changed.")
    databases: list[BreakerEntry]


# --------------------------------------------------------------------------- #
# Queries, hot data, events
# --------------------------------------------------------------------------- #


class TopQuery(Payload):
    fingerprint: str
    query: str = Field(description="Normalized, anonymized text.")
    calls: int
    errors: int
    rows: int
    total_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    share: float = Field(description="Share of the total time of all fingerprints (0..1).")
    queue_ms_mean: float
    backend_ms_mean: float
    total_ms_mean: float
    first_seen: float
    last_seen: float
    histogram: list[tuple[float, int]] | None = Field(
        None,
        description=(
            "With ?histogram=true: the latency histogram, [ms, count] per bucket, "
            "ascending (each bucket as the value its percentiles take, within 1.6%). "
            "Proxies bucket alike: add the counts of equal values to merge several "
            "(admin.histograms)."
        ),
    )


class TopQueries(Payload):
    by: Literal["total_time", "mean", "calls", "errors", "p99"]
    window_seconds: float | None
    limit: int
    queries: list[TopQuery]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class HotTable(Payload):
    table: str
    count: float


class HotValue(Payload):
    column: str
    value: str = Field(description="Keyed hash of the value, never the value itself.")
    count: float


class HotData(Payload):
    tables: list[HotTable]
    values: list[HotValue]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class TailEvent(Payload):
    """One completed query (NDJSON line or SSE ``event: query``)."""

    type: Literal["query"] = "query"
    ts: float
    worker: int
    client_id: str
    database: str
    user: str
    application_name: str
    fingerprint: str
    query: str = Field(description="Normalized, anonymized text (raw only with anonymize off).")
    queue_us: int
    pool_acquire_us: int
    backend_us: int
    total_us: int
    rows: int
    sqlstate: str | None
    pinned: bool
    pin_reasons: list[str]


class TailNotice(Payload):
    """A control line of the tail: a heartbeat, or events dropped for a slow reader."""

    type: Literal["heartbeat", "dropped"]
    ts: float
    dropped: int = Field(description="Events dropped for this reader so far.")
    missing: list[WorkerMissing] | None = _fleet_field(
        "Workers whose events this stream is not receiving now (with several workers)."
    )


# --------------------------------------------------------------------------- #
# Operations
# --------------------------------------------------------------------------- #


class KillResult(Payload):
    client_id: str
    killed: bool
    worker: int | None = _fleet_field(_WORKER)


class ReloadResult(Payload):
    reloaded: bool
    config_path: str
    databases: list[str]
    fleet: FleetInfo | None = _fleet_field(_FLEET)


class PauseResult(Payload):
    paused: bool = Field(description="Whether any pool is paused now.")
    database: str | None = Field(description="The database acted on; None for all.")
    complete: bool = Field(
        description="Pause: every server finished and was closed within the wait. Resume: true."
    )
    fleet: FleetInfo | None = _fleet_field(_FLEET)


# --------------------------------------------------------------------------- #
# The OpenAPI document
# --------------------------------------------------------------------------- #

_JSON_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse, Health, Status, PoolList, ClientList, ServerList, PinList, UnpinResult,
    BreakerList, BreakerActionResult, TopQueries, HotData, TailEvent, TailNotice, KillResult,
    ReloadResult, PauseResult,
)  # fmt: skip


def _param(name: str, where: str, schema: dict[str, Any], description: str, required: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "in": where, "required": required, "schema": schema, "description": description}  # fmt: skip


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _errors(*codes: int) -> dict[str, Any]:
    texts = {
        400: "Bad request (a parameter is invalid).",
        401: "Missing or wrong token.",
        403: "Read-only, or actions without a configured token.",
        404: "No such client or database.",
        409: "Not possible in the current state.",
        501: "Not implemented by this proxy.",
        503: "No worker of the instance answered in time.",
    }
    return {str(code): _json(ErrorResponse, texts[code]) for code in codes}


def openapi_document(version: str = "0") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the admin API (served at ``/api/v1/openapi.json``)."""
    _, defs = models_json_schema(
        [(m, "serialization") for m in _JSON_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = defs.get("$defs", {})
    limit = {"type": "integer", "minimum": 1, "maximum": 1000}
    offset = {"type": "integer", "minimum": 0}
    client_id = _param(
        "client_id",
        "path",
        {"type": "string"},
        "A client id as listed: c123, or w1.c123 with several workers.",
        True,
    )
    database = _param("database", "query", {"type": "string"}, "One database; all when omitted.")
    worker = _param(
        "worker",
        "query",
        {"type": "integer", "minimum": 0, "maximum": 63},
        "With several workers: one worker's view (the whole instance when omitted).",
    )
    secured: list[dict[str, list[str]]] = [{"bearer": []}]

    def get(model: type[BaseModel], summary: str, params: list[dict[str, Any]] | None = None, extra: tuple[int, ...] = ()) -> dict[str, Any]:  # fmt: skip
        return {
            "get": {
                "summary": summary,
                "parameters": [*(params or []), worker],
                "responses": {"200": _json(model, summary), **_errors(400, 401, 503, *extra)},
            }
        }

    def post(model: type[BaseModel], summary: str, params: list[dict[str, Any]] | None = None, extra: tuple[int, ...] = ()) -> dict[str, Any]:  # fmt: skip
        return {
            "post": {
                "summary": summary,
                "parameters": params or [],
                "responses": {"200": _json(model, summary), **_errors(401, 403, *extra)},
            }
        }

    p = API_PREFIX
    paths: dict[str, Any] = {
        "/healthz": {
            "get": {
                "summary": "Liveness (no token needed).",
                "security": [],
                "responses": {"200": _json(Health, "Alive.")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text exposition (the instance's, or ?worker=N's own).",
                "parameters": [worker],
                "responses": {
                    "200": {
                        "description": "Metrics.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(400, 401, 503),
                },
            }
        },
        f"{p}/openapi.json": {
            "get": {
                "summary": "This document.",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_errors(401),
                },
            }
        },
        f"{p}/status": get(Status, "Version, uptime, pool mode, workers, listen addresses."),
        f"{p}/pools": get(PoolList, "Per database/user pool: size, active, idle, waiting, pinned."),
        f"{p}/clients": get(
            ClientList,
            "Client connections (paginated, ordered by id).",
            [
                _param("limit", "query", limit, "Page size (default 100)."),
                _param("offset", "query", offset, "Clients to skip."),
            ],
            (400,),
        ),
        f"{p}/clients/{{client_id}}/kill": post(
            KillResult,
            "Disconnect a client (SQLSTATE 57P01).",
            [client_id, worker],
            (400, 404, 503),
        ),
        f"{p}/servers": get(
            ServerList,
            "Server connections (paginated, ordered by id).",
            [
                _param("limit", "query", limit, "Page size (default 100)."),
                _param("offset", "query", offset, "Servers to skip."),
            ],
            (400,),
        ),
        f"{p}/pins": get(PinList, "Pinned sessions (hybrid mode)."),
        f"{p}/pins/{{client_id}}/unpin": post(
            UnpinResult,
            "Force-unpin: replay what can be replayed, say what could not.",
            [
                client_id,
                worker,
                _param(
                    "disconnect",
                    "query",
                    {"type": "boolean"},
                    "Disconnect a client whose state cannot be replayed.",
                ),
            ],
            (400, 404, 503),
        ),
        f"{p}/breaker": get(BreakerList, "Circuit breakers and health signals per database."),
        f"{p}/breaker/trip": post(
            BreakerActionResult,
            "Open the breaker (held open until reset).",
            [database, _param("reason", "query", {"type": "string"}, "Why (shown to clients).")],
            (404,),
        ),
        f"{p}/breaker/reset": post(BreakerActionResult, "Close the breaker.", [database], (404,)),
        f"{p}/queries/top": get(
            TopQueries,
            "Fingerprint ranking.",
            [
                _param("by", "query", {"type": "string", "enum": list(RANKINGS)}, "Ranking."),
                _param("limit", "query", limit, "How many (default 50)."),
                _param(
                    "window",
                    "query",
                    {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
                    "Seconds; since start when omitted.",
                ),
                _param(
                    "histogram",
                    "query",
                    {"type": "boolean"},
                    "Add each fingerprint's latency histogram (to merge several proxies').",
                ),
            ],
            (400,),
        ),
        f"{p}/hot": get(
            HotData,
            "Hot tables and values.",
            [_param("limit", "query", limit, "How many.")],
            (400,),
        ),
        "/debug/hot_data": get(
            HotData, "Same as /api/v1/hot.", [_param("limit", "query", limit, "How many.")], (400,)
        ),
        f"{p}/tail": {
            "get": {
                "summary": "Live stream of anonymized query events: NDJSON, or SSE with "
                "Accept: text/event-stream. Each line is a TailEvent or a TailNotice.",
                "parameters": [
                    _param("fingerprint", "query", {"type": "string"}, "Only this fingerprint."),
                    _param("min_ms", "query", {"type": "number", "minimum": 0}, "Slower than."),
                    _param("errors", "query", {"type": "boolean"}, "Only failed statements."),
                    _param("database", "query", {"type": "string"}, "Only this database."),
                    _param("client_id", "query", {"type": "string"}, "Only this client."),
                    worker,
                ],
                "responses": {
                    "200": {
                        "description": "A stream of TailEvent / TailNotice objects.",
                        "content": {
                            "application/x-ndjson": {"schema": _ref(TailEvent)},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **_errors(400, 401, 503),
                },
            }
        },
        f"{p}/pause": post(
            PauseResult,
            "PgBouncer's PAUSE: hold new transactions, let running ones finish, close servers.",
            [
                database,
                _param(
                    "wait",
                    "query",
                    {"type": "number", "minimum": 0, "maximum": 60},
                    "Seconds to wait for running transactions (default 5).",
                ),
            ],
            (404, 501, 503),
        ),
        f"{p}/resume": post(PauseResult, "PgBouncer's RESUME.", [database], (404, 501, 503)),
        f"{p}/reload": post(ReloadResult, "Re-read the config file.", extra=(400, 409, 503)),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "scry admin API",
            "version": version,
            "description": "JSON over HTTP; see docs/admin-api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": secured,
    }
