"""pgbouncer.ini: PgBouncer's reading rules and the conversion to scry's Config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scry.pgbouncer.ini import (
    PGBOUNCER_KEYS,
    IniError,
    convert,
    load_pgbouncer_config,
    parse_connstring,
    parse_ini,
)

MAIN = """\
;; pgbouncer.ini of a typical production box
# both comment styles; neither is special later in a line
[databases]
; the application database, via TCP
app = host=10.0.0.5 port=5433 dbname=app_prod pool_size=30 min_pool_size=5 reserve_pool=3
; a forced user, with a quoted password and startup settings
reports = host=10.0.0.6 user=reporter password='it''s secret' client_encoding=UTF8 datestyle=ISO timezone=UTC pool_mode=session query_wait_timeout=5
; over the Unix socket (no host), with a query run on each new server
local = dbname=postgres connect_query='SET lock_timeout = 1000' target_session_attrs=read-write query_wait_timeout=-1
"quoted db" = host=10.0.0.7
; anything else goes to the fallback
* = host=10.0.0.9 port=6000

[pgbouncer]
listen_addr = 10.1.1.1, 10.1.1.2
listen_port = 6543
unix_socket_dir = /var/run/postgresql
auth_type = scram-sha-256
auth_file = /etc/pgbouncer/userlist.txt
admin_users = ops, root
stats_users = grafana
pool_mode = transaction
default_pool_size = 10
max_client_conn = 2000
server_check_delay = 0
server_reset_query = DISCARD ALL
query_wait_timeout = 30
cancel_wait_timeout = 3
pool_idle_timeout = 5min
login_notify_message = connected through the pooler
dns_max_ttl = 30
server_lifetime = 1h
idle_transaction_timeout = 1.5
tcp_keepcnt = 5
suspend_timeout = 20
sbuf_loopcnt = 10
log_connections = 1
tcp_keepalive = 1
logfile = /var/log/pgbouncer/pgbouncer.log
pidfile = /var/run/pgbouncer/pgbouncer.pid
ignore_startup_parameters = extra_float_digits, options
peer_id = 1
%include {include}

[users]
batch = pool_mode=session pool_size=2 max_user_connections=4 client_idle_timeout=30 query_wait_timeout=0
web = query_wait_timeout=-1

[peers]
1 = host=10.0.0.21
2 = host=10.0.0.22 port=6544

; a section may come back: its keys merge, the last value of a key wins
[databases]
app = host=10.0.0.5 port=5433 dbname=app_prod pool_size=40
"""

INCLUDED = """\
[pgbouncer]
; repeated keys: the last one wins (this file is read after the lines above)
default_pool_size = 25
tcp_keepcnt = 7
suspend_timeout = 2.5
sbuf_loopcnt = 10
server_login_retry = 30
server_round_robin = 1
server_fast_close = 1
"""


@pytest.fixture
def ini_path(tmp_path: Path) -> Path:
    include = tmp_path / "extra.ini"
    include.write_text(INCLUDED)
    main = tmp_path / "pgbouncer.ini"
    main.write_text(MAIN.format(include=include))
    return main


def test_effective_config(ini_path: Path) -> None:
    config, warnings = load_pgbouncer_config(ini_path, env={})
    assert config.listen_addr == "10.1.1.1:6543"
    assert config.pool.mode == "transaction"
    assert config.pool.size == 25  # from %include, after the main file's 10
    assert config.pool.max_client_conn == 2000
    assert config.auth is not None
    assert (config.auth.type, config.auth.auth_file) == (
        "scram-sha-256",
        "/etc/pgbouncer/userlist.txt",
    )
    assert config.timeouts.query_wait_timeout == 30
    assert config.timeouts.cancel_wait_timeout == 3
    assert config.timeouts.pool_idle_timeout == 300
    assert config.login_notify_message == "connected through the pooler"
    assert (config.dns_max_ttl, config.dns_nxdomain_ttl) == (30, 15)
    assert config.timeouts.server_lifetime == 3600
    assert config.timeouts.idle_transaction_timeout == 1.5
    assert 0 < config.timeouts.server_check_delay < 0.001  # PgBouncer's 0 = check every time
    assert config.max_packet_size == 2147483647
    assert config.pool.server_round_robin and config.pool.server_fast_close  # from %include
    assert config.timeouts.server_login_retry == 30
    assert (config.tcp_keepalive, config.tcp_keepcnt) == (True, 7)  # the include's 7 wins

    targets = config.targets()
    assert set(targets) == {"app", "reports", "local", "quoted db"}
    app = targets["app"]
    assert (app.host, app.port, app.dbname, app.user) == ("10.0.0.5", 5433, "app_prod", None)
    assert app.pool.size == 40  # the repeated [databases] section wins
    assert app.pool.min_size == 0  # ... and replaces the whole earlier line
    reports = targets["reports"]
    assert (reports.user, reports.password, reports.dbname) == (
        "reporter",
        "it's secret",
        "reports",
    )
    assert reports.params == {"client_encoding": "UTF8", "DateStyle": "ISO", "TimeZone": "UTC"}
    assert reports.pool.mode == "session"
    local = targets["local"]
    assert (local.host, local.port, local.dbname) == ("/var/run/postgresql", 5432, "postgres")
    assert local.pool.connect_query == "SET lock_timeout = 1000"
    assert local.target_session_attrs == "read-write"
    assert app.pool.connect_query == ""
    # query_wait_timeout per database: -1 is PgBouncer's "not set"
    assert reports.pool.query_wait_timeout == 5
    assert local.pool.query_wait_timeout is None and app.pool.query_wait_timeout is None

    compat = config.pgbouncer
    assert compat is not None
    assert compat.admin_users == ["ops", "root"]
    assert compat.stats_users == ["grafana"]
    assert compat.unix_socket_dir == "/var/run/postgresql"
    assert compat.logfile == "/var/log/pgbouncer/pgbouncer.log"
    assert compat.pidfile == "/var/run/pgbouncer/pgbouncer.pid"
    assert compat.ignore_startup_parameters == ["extra_float_digits", "options"]
    assert compat.users["batch"].pool_mode == "session"
    assert compat.users["batch"].pool_size == 2
    assert compat.users["batch"].max_user_connections == 4
    timeouts = config.user_timeouts()  # (the global ones, but what the line sets)
    assert set(timeouts) == {"batch"} and timeouts["batch"].client_idle_timeout == 30
    assert timeouts["batch"].query_wait_timeout == config.timeouts.query_wait_timeout
    # A [users] line goes over the database's pool settings, query_wait_timeout
    # included (0: batch's clients wait as long as it takes).
    assert compat.users["batch"].query_wait_timeout == 0
    assert compat.users["web"].query_wait_timeout is None
    batch = config.pool_settings(reports, "batch")
    assert (batch.mode, batch.size, batch.query_wait_timeout) == ("session", 2, 0)
    assert batch.max_user_connections == 4
    assert config.pool_settings(reports, "web").query_wait_timeout == 5
    assert config.pool_settings(reports, "nobody") is reports.pool
    assert compat.autodb is not None and "host=10.0.0.9" in compat.autodb.database_url
    assert compat.conffile == str(ini_path)
    assert compat.suspend_timeout == 2.5  # (the last of two lines)
    assert config.log.syslog_ident == "pgbouncer" and not config.log.syslog  # (PgBouncer's)
    assert config.peer_id == 1
    assert config.peers == {2: "10.0.0.22:6544"}  # its own entry (1) is skipped


def test_each_unsupported_key_is_reported_once(ini_path: Path) -> None:
    _, warnings = load_pgbouncer_config(ini_path, env={})
    unsupported = sorted(w.split(" ")[2] for w in warnings if w.startswith("not supported: "))
    # sbuf_loopcnt is set twice, reported once; tcp_keepalive = 1 and
    # log_connections = 1 are PgBouncer's defaults: nothing to report.
    assert unsupported == ["sbuf_loopcnt"], warnings
    assert not any("max_user_connections" in w for w in warnings)  # in effect
    assert any(w.startswith("differs: listen_addr") for w in warnings)
    assert len(warnings) == len(set(warnings))


def test_pgbouncer_defaults_where_scry_differs(tmp_path: Path) -> None:
    path = tmp_path / "min.ini"
    path.write_text("[databases]\ndb = host=127.0.0.1\n[pgbouncer]\nlisten_addr = 127.0.0.1\n")
    config, warnings = load_pgbouncer_config(path, env={})
    assert warnings == []
    assert config.listen_addr == "127.0.0.1:6432"
    assert config.pool.mode == "session"
    assert config.pool.max_client_conn == 100
    assert config.auth is not None and config.auth.type == "md5"
    assert config.pgbouncer is not None and config.pgbouncer.unix_socket_dir == "/tmp"
    assert config.tcp_defer_accept  # PgBouncer's default on Linux


def load_minimal(tmp_path: Path, lines: str = "") -> tuple[Any, list[str]]:
    """A one-database pgbouncer.ini with ``lines`` added to [pgbouncer], loaded."""
    path = tmp_path / "minimal.ini"
    path.write_text(
        "[databases]\ndb = host=127.0.0.1\n[pgbouncer]\nlisten_addr = 127.0.0.1\n" + lines
    )
    return load_pgbouncer_config(path, env={})


def test_tcp_defer_accept_can_be_turned_off(tmp_path: Path) -> None:
    config, warnings = load_minimal(tmp_path, "tcp_defer_accept = 0\n")
    assert warnings == [] and config.tcp_defer_accept is False


def test_tcp_keepalive_settings_are_taken(tmp_path: Path) -> None:
    config, warnings = load_minimal(
        tmp_path,
        "tcp_keepalive = 0\ntcp_keepidle = 60\ntcp_keepintvl = 5\ntcp_keepcnt = 3\n"
        "tcp_user_timeout = 9000\n",
    )
    assert warnings == []
    assert (
        config.tcp_keepalive,
        config.tcp_keepidle,
        config.tcp_keepintvl,
        config.tcp_keepcnt,
        config.tcp_user_timeout,
    ) == (False, 60, 5, 3, 9000)
    assert not config.application_name_add_host  # PgBouncer's default


def test_application_name_add_host_is_taken(tmp_path: Path) -> None:
    config, warnings = load_minimal(tmp_path, "application_name_add_host = 1\n")
    assert warnings == [] and config.application_name_add_host


def test_every_documented_key_is_known() -> None:
    for key in ("listen_addr", "so_reuseport", "peer_id", "client_tls13_ciphers",
                "max_user_client_connections", "auth_ldap_options", "transaction_timeout",
                "query_wait_notify", "track_extra_parameters", "scram_iterations"):  # fmt: skip
        assert key in PGBOUNCER_KEYS


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("no_such_key = 1", "unknown parameter: pgbouncer/no_such_key"),
        ("auth_type = pam", "auth_type = pam is not supported"),
        ("pool_mode = bogus", "pool.mode"),
        ("max_client_conn = many", "expected an integer"),
        ("server_lifetime = soon", "expected seconds"),
        ("server_reset_query_always = maybe", "expected a boolean"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.ini"
    path.write_text(f"[databases]\ndb = host=h\n[pgbouncer]\n{line}\n")
    with pytest.raises(IniError, match=message):
        load_pgbouncer_config(path, env={})


def test_reading_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.ini"
    path.write_text("[databases]\n\ndb host=h\n")
    with pytest.raises(IniError, match=r"bad\.ini:3: expected 'key = value'"):
        parse_ini(path)
    path.write_text("[nonsense]\n")
    with pytest.raises(IniError, match="unknown section"):
        parse_ini(path)
    path.write_text("%include missing.ini\n")
    with pytest.raises(IniError, match="cannot read missing.ini"):
        parse_ini(path)
    path.write_text(f"%include {path}\n")
    with pytest.raises(IniError, match="nested more than"):
        parse_ini(path)
    path.write_text("[databases]\npgbouncer = host=h\n")
    with pytest.raises(IniError, match="reserved"):
        convert(parse_ini(path))


def test_reading_errors_do_not_quote_passwords(tmp_path: Path) -> None:
    path = tmp_path / "bad.ini"
    path.write_text("[databases]\nmy app = host=h password=hunter2\n")
    with pytest.raises(IniError) as caught:
        convert(parse_ini(path))
    assert "hunter2" not in str(caught.value) and "password=***" in str(caught.value)
    with pytest.raises(IniError) as caught:
        parse_connstring('host=h "x"=1 password=hunter2', "t")
    assert "hunter2" not in str(caught.value)


def test_connstring_quoting() -> None:
    assert parse_connstring("host=h  password='a b''c' x='\\'y'", "t") == {
        "host": "h",
        "password": "a b'c",
        "x": "'y",
    }
    with pytest.raises(IniError, match="unterminated"):
        parse_connstring("password='abc", "t")


def test_scry_section_and_env(tmp_path: Path) -> None:
    path = tmp_path / "s.ini"
    path.write_text(
        "[databases]\ndb = host=h\n[pgbouncer]\npool_mode = session\n"
        "[scry]\npool.mode = hybrid\nadmin.listen_addr = 127.0.0.1:7000\n"
    )
    config, _ = load_pgbouncer_config(path, env={"SCRY_ADMIN__ENABLED": "false"})
    assert config.pool.mode == "hybrid"
    assert config.admin.listen_addr == "127.0.0.1:7000"
    assert config.admin.enabled is False


def test_set_overrides(tmp_path: Path) -> None:
    path = tmp_path / "s.ini"
    path.write_text("[databases]\ndb = host=h\n[pgbouncer]\ndefault_pool_size = 5\n")
    config, _ = load_pgbouncer_config(path, {"default_pool_size": "9"}, env={})
    assert config.pool.size == 9


def test_statement_mode_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "s.ini"
    path.write_text("[databases]\ndb = host=h pool_mode=statement\n")
    config, _ = load_pgbouncer_config(path, env={})
    assert config.targets()["db"].pool.mode == "statement"


def test_auth_user_query_and_dbname_map_to_auth(tmp_path: Path) -> None:
    path = tmp_path / "aq.ini"
    path.write_text(
        "[databases]\ndb = host=127.0.0.1 auth_user=other server_lifetime=600\n"
        "lookups = host=127.0.0.1 auth_query='SELECT usename, passwd FROM mine WHERE usename=$1'\n"
        "[pgbouncer]\nlisten_addr = 127.0.0.1\nauth_user = lookup\nauth_dbname = lookups\n"
        "auth_query = SELECT usename, passwd FROM pg_shadow WHERE usename=$1\n"
    )
    config, warnings = load_pgbouncer_config(path, env={})
    assert config.auth is not None
    assert (config.auth.auth_user, config.auth.auth_dbname) == ("lookup", "lookups")
    assert config.auth.auth_query == "SELECT usename, passwd FROM pg_shadow WHERE usename=$1"
    assert not any("auth_" in w for w in warnings), warnings
    # A database's own auth_user (and '*''s, for the databases made from it) wins.
    assert config.targets()["db"].auth_user == "other"
    assert config.targets()["lookups"].auth_user is None
    # ... and its auth_query and server_lifetime (PgBouncer's per-database ones).
    assert (
        config.targets()["lookups"].auth_query
        == "SELECT usename, passwd FROM mine WHERE usename=$1"
    )
    assert config.targets()["db"].auth_query is None
    assert config.targets()["db"].pool.server_lifetime == 600
    assert config.targets()["lookups"].pool.server_lifetime is None  # timeouts.server_lifetime
    path.write_text(
        "[databases]\n* = host=127.0.0.1 auth_user=lookup auth_dbname=main\n"
        "main = host=127.0.0.1\n[pgbouncer]\nlisten_addr = 127.0.0.1\n"
    )
    config, _ = load_pgbouncer_config(path, env={})
    assert config.pgbouncer is not None and config.pgbouncer.autodb is not None
    autodb = config.pgbouncer.autodb
    assert (autodb.auth_user, autodb.auth_dbname) == ("lookup", "main")


def test_host_lists_and_load_balance_hosts_are_taken(tmp_path: Path) -> None:
    path = tmp_path / "hosts.ini"
    path.write_text(
        "[databases]\nspread = host=10.0.0.1,10.0.0.2 port=6000\n"
        "failover = host=10.0.0.1,10.0.0.2 load_balance_hosts=disable\n"
        "[pgbouncer]\nlisten_addr = 127.0.0.1\n"
    )
    config, warnings = load_pgbouncer_config(path, env={})
    spread, failover = config.targets()["spread"], config.targets()["failover"]
    assert spread.hosts == (("10.0.0.1", 6000), ("10.0.0.2", 6000))
    assert spread.load_balance_hosts == "round-robin"
    assert failover.hosts == (("10.0.0.1", 5432), ("10.0.0.2", 5432))
    assert failover.load_balance_hosts == "disable"
    assert not any("host" in w for w in warnings), warnings
    path.write_text("[databases]\ndb = host=a,b load_balance_hosts=random\n")
    with pytest.raises(IniError, match="hosts.ini:2: load_balance_hosts = random: expected"):
        load_pgbouncer_config(path, env={})


def test_connection_limits_become_pool_settings(tmp_path: Path) -> None:
    path = tmp_path / "limits.ini"
    path.write_text(
        "[databases]\n"
        "app = host=127.0.0.1 max_db_connections=7 max_db_client_connections=70\n"
        "other = host=127.0.0.1\n"
        "[users]\n"
        "batch = max_user_connections=2 max_user_client_connections=20\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        "max_db_connections = 30\n"
        "max_user_connections = 12\n"
        "max_db_client_connections = 300\n"
        "max_user_client_connections = 120\n"
    )
    config, warnings = load_pgbouncer_config(path, env={})
    assert warnings == []
    pool = config.pool
    assert (pool.max_db_connections, pool.max_user_connections) == (30, 12)
    assert (pool.max_db_client_connections, pool.max_user_client_connections) == (300, 120)
    targets = config.targets()
    assert targets["app"].pool.max_db_connections == 7
    assert targets["app"].pool.max_db_client_connections == 70
    assert targets["other"].pool.max_db_connections == 30
    assert config.pgbouncer is not None
    assert config.pgbouncer.users["batch"].max_user_connections == 2
    assert config.pgbouncer.users["batch"].max_user_client_connections == 20


def test_query_wait_notify_and_transaction_timeout_are_taken(tmp_path: Path) -> None:
    config, _ = load_minimal(tmp_path)
    assert config.timeouts.query_wait_notify == 5  # PgBouncer's defaults
    assert config.timeouts.transaction_timeout == 0
    config, warnings = load_minimal(tmp_path, "query_wait_notify = 0\ntransaction_timeout = 90\n")
    assert warnings == []
    assert (config.timeouts.query_wait_notify, config.timeouts.transaction_timeout) == (0, 90)


def test_tls_versions_ciphers_and_curve_are_taken(tmp_path: Path) -> None:
    config, warnings = load_minimal(
        tmp_path,
        "client_tls_protocols = tlsv1.3\nclient_tls_ciphers = fast\n"
        "client_tls_ecdhcurve = prime256v1\nserver_tls_protocols = all\n"
        "server_tls_ciphers = HIGH:!aNULL\nclient_tls13_ciphers = TLS_AES_256_GCM_SHA384\n",
    )
    tls = config.tls
    assert (tls.client_tls_protocols, tls.client_tls_ciphers, tls.client_tls_ecdhcurve) == (
        "tlsv1.3",
        "fast",
        "prime256v1",
    )
    assert (tls.server_tls_protocols, tls.server_tls_ciphers) == ("all", "HIGH:!aNULL")
    assert [w.split(" ")[2] for w in warnings] == ["client_tls13_ciphers"], warnings


@pytest.mark.parametrize(
    ("lines", "period"),
    [("", 60), ("stats_period = 15\n", 15), ("log_stats = 0\nstats_period = 15\n", 0)],
)
def test_log_stats_logs_every_stats_period(tmp_path: Path, lines: str, period: int) -> None:
    config, warnings = load_minimal(tmp_path, lines)
    assert warnings == [] and config.log.stats_period == period


def test_so_reuseport_socket_directory_peers_and_scram_iterations(tmp_path: Path) -> None:
    # The multi-process layout of PgBouncer's docs: each process its own
    # peer_id and socket directory, every peer named by its directory.
    extra = (
        "so_reuseport = 1\npeer_id = 1\nscram_iterations = 10000\ndisable_pqexec = 1\n"
        "[peers]\n1 = host=/run/pgb1\n2 = host=/run/pgb2 port=6433\n"
    )
    config, warnings = load_minimal(tmp_path, extra)
    assert warnings == []
    assert config.so_reuseport and config.peer_id == 1 and config.disable_pqexec
    assert config.auth is not None and config.auth.scram_iterations == 10000
    assert config.peers == {2: "/run/pgb2:6433"}
    # Below RFC 7677's 4096 (PgBouncer allows it; scramp does not): reported.
    config, warnings = load_minimal(tmp_path, "scram_iterations = 1024\n")
    assert warnings == ["not supported: scram_iterations (below 4096, RFC 7677's floor)"]
    assert config.auth is not None and config.auth.scram_iterations == 4096


def test_listen_backlog_socket_buffers_and_user_are_taken(tmp_path: Path) -> None:
    config, warnings = load_minimal(
        tmp_path, "listen_backlog = 77\ntcp_socket_buffer = 50000\nuser = postgres\n"
    )
    assert warnings == []
    assert (config.listen_backlog, config.tcp_socket_buffer) == (77, 50000)
    assert config.pgbouncer is not None and config.pgbouncer.user == "postgres"
    config, _ = load_minimal(tmp_path, "")
    assert (config.listen_backlog, config.tcp_socket_buffer) == (4096, 0)  # scry's defaults
