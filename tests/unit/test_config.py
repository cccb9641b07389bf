"""Unit tests for scry.config and the check-config command (no database needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from scry.cli import app
from scry.config import (
    Config,
    ConfigError,
    DatabaseTarget,
    PoolConfig,
    is_loopback_host,
    load_config,
    split_host_port,
)

SEED_YAML = """\
listen_addr: "0.0.0.0:6432"
database_url: "postgres://user:pass@localhost:5432/mydb"
pool:
  mode: hybrid          # session | transaction | hybrid (default hybrid)
  size: 100
circuit_breaker:
  failure_threshold: 5
  success_threshold: 3
  timeout_seconds: 30
"""

SECRET = "s3cr3t-P@ss"


def write(tmp_path: Path, text: str, name: str = "scry.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=env or {})
    return str(info.value)


# --------------------------------------------------------------------------- #
# Loading and defaults
# --------------------------------------------------------------------------- #


def test_seed_example_loads_unchanged(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SEED_YAML), env={})
    assert cfg.listen_addr == "0.0.0.0:6432"
    assert cfg.listen_host_port == ("0.0.0.0", 6432)
    assert cfg.pool.mode == "hybrid"
    assert cfg.pool.size == 100
    assert cfg.circuit_breaker.failure_threshold == 5
    assert cfg.circuit_breaker.success_threshold == 3
    assert cfg.circuit_breaker.timeout_seconds == 30
    target = cfg.targets()["mydb"]
    assert (target.host, target.port, target.dbname, target.user, target.password) == (
        "localhost",
        5432,
        "mydb",
        "user",
        "pass",
    )


def test_defaults() -> None:
    cfg = Config(database_url="postgres://localhost/db")
    assert cfg.listen_addr == "127.0.0.1:6432"
    assert cfg.pool == PoolConfig()
    assert cfg.pool.mode == "hybrid" and cfg.pool.size == 20 and cfg.pool.min_size == 0
    assert cfg.pool.idle_unpin_seconds == 300
    assert cfg.pool.server_reset_query == "DISCARD ALL"
    assert cfg.timeouts.query_wait_timeout == 120
    assert cfg.timeouts.server_lifetime == 3600
    assert cfg.timeouts.server_idle_timeout == 600
    assert cfg.timeouts.server_connect_timeout == 15
    assert cfg.timeouts.client_login_timeout == 60
    assert cfg.timeouts.query_timeout == 0
    assert cfg.timeouts.shutdown_timeout == 0
    assert cfg.admin.listen_addr == "127.0.0.1:6480"
    assert cfg.admin.enabled and not cfg.admin.read_only
    assert cfg.observability.events.sink == "none"
    assert cfg.observability.events.batch_size == 100
    assert cfg.observability.hot_data.width == 2048
    assert cfg.tls.client_tls_sslmode == "disable"
    assert cfg.tls.server_tls_sslmode == "prefer"
    assert cfg.workers == 1
    assert cfg.auth is None
    assert cfg.max_packet_size == 1073741823


def test_empty_file_without_database_is_refused(tmp_path: Path) -> None:
    assert "config needs database_url or databases" in error_for(tmp_path, "")


def test_empty_sections_mean_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SEED_YAML + "timeouts:\nlog:\n"), env={})
    assert cfg.timeouts.query_wait_timeout == 120


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml", env={})


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    message = error_for(tmp_path, "database_url: x\npool:\n  size: [1\n")
    assert "scry.yaml:" in message
    assert "YAML syntax error" in message


def test_duplicate_key_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, SEED_YAML + "pool:\n  size: 3\n")
    assert "scry.yaml:" in message and "duplicate key 'pool'" in message


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    assert "mapping" in error_for(tmp_path, "- a\n- b\n")


# --------------------------------------------------------------------------- #
# Validation errors name the key path
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("pool:\n  size: abc\n", "pool.size: expected an integer, found 'abc'"),
        ("pool:\n  sise: 3\n", "pool.sise: unknown key (did you mean 'size'?)"),
        ("pool:\n  mode: hybird\n", "pool.mode: expected one of"),
        ("pool:\n  size: 0\n", "pool.size: expected a number >= 1, found 0"),
        ("pool:\n  size: true\n", "pool.size: expected a number, found True"),
        ("pool:\n  size: 2\n  min_size: 5\n", "pool.min_size: must not exceed size (2)"),
        ("timeouts:\n  query_timeout: -1\n", "timeouts.query_timeout: expected a number >= 0"),
        ("log:\n  level: loud\n", "log.level: expected one of"),
        ("tls:\n  client_tls_sslmode: on\n", "tls.client_tls_sslmode: expected one of"),
        ("workers: many\n", "workers: expected a positive integer or 'auto', found 'many'"),
        ("max_packet_size: 10\n", "max_packet_size: expected a number >= 1024"),
        (
            "max_packet_size: 99999999999999999999\n",
            "max_packet_size: expected a number <= 2147483647",
        ),
        ("listen_addr: nowhere\n", "listen_addr: expected 'host:port'"),
        ("bogus: 1\n", "bogus: unknown key"),
        ("observability:\n  events:\n    sink: file\n", "observability.events.path: sink 'file'"),
        ("observability:\n  events:\n    sink: http\n", "observability.events.url: sink 'http'"),
        ("auth:\n  users:\n    - {password: x}\n", "auth.users[0].name: required key is missing"),
        ("peers:\n  1: nowhere\n", "peers.1: expected 'host:port'"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, extra: str, expected: str) -> None:
    base = 'database_url: "postgres://localhost/db"\n'
    assert expected in error_for(tmp_path, base + extra)


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    message = error_for(
        tmp_path, 'database_url: "postgres://localhost/db"\npool:\n  size: x\n  mode: y\n'
    )
    assert message.startswith("2 problems in ")
    assert "pool.size" in message and "pool.mode" in message


def test_secret_values_not_echoed_in_errors(tmp_path: Path) -> None:
    message = error_for(
        tmp_path, SEED_YAML + "auth:\n  users:\n    - {name: a, password: [hunter2]}\n"
    )
    assert "auth.users[0].password: expected a string" in message
    assert "hunter2" not in message
    # Users written as a mapping or a "name password" string hold passwords too.
    for users in ("{bob: hunter2}", '["bob hunter2"]', "[{name: bob, pasword: hunter2}]"):
        message = error_for(tmp_path, SEED_YAML + f"auth:\n  users: {users}\n")
        assert "auth.users" in message and "hunter2" not in message, message
    message = error_for(tmp_path, SEED_YAML + "timeouts: [x, {password: hunter2}]\n")
    assert "timeouts: expected" in message and "found a value of type list" in message
    assert "hunter2" not in message


def test_workers_auto_and_int(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, SEED_YAML + "workers: auto\n"), env={}).workers == "auto"
    assert load_config(write(tmp_path, SEED_YAML + "workers: 4\n"), env={}).workers == 4


def test_listen_addr_forms() -> None:
    assert split_host_port("[::1]:6432") == ("::1", 6432)
    assert split_host_port("localhost:1") == ("localhost", 1)
    for bad in ("::1:6432", "host", "host:99999", ":5432", "[::1]6432"):
        with pytest.raises(ValueError):
            split_host_port(bad)
    Config(listen_addr="[::1]:6432", database_url="postgres://localhost/db")


# --------------------------------------------------------------------------- #
# Admin endpoint safety
# --------------------------------------------------------------------------- #


def test_non_loopback_admin_without_token_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, SEED_YAML + "admin:\n  listen_addr: '0.0.0.0:6480'\n")
    assert "admin.listen_addr" in message and "token" in message


@pytest.mark.parametrize("addr", ["127.0.0.1:6480", "127.5.5.5:1", "[::1]:6480", "localhost:6480"])
def test_loopback_admin_without_token_ok(tmp_path: Path, addr: str) -> None:
    cfg = load_config(write(tmp_path, SEED_YAML + f"admin:\n  listen_addr: '{addr}'\n"), env={})
    assert cfg.admin.token is None


def test_is_loopback_host() -> None:
    assert is_loopback_host("127.0.0.2") and is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("db.example.com")


def test_admin_token_file_read_at_load(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  tok-123\n")
    cfg = load_config(
        write(
            tmp_path,
            SEED_YAML + f"admin:\n  listen_addr: '0.0.0.0:6480'\n  token_file: '{token_file}'\n",
        ),
        env={},
    )
    assert cfg.admin.token == "tok-123"
    assert cfg.admin.token_file == str(token_file)


@pytest.mark.parametrize("token", ["'   '", "' tok-123'", '"tok-123\\n"'])
def test_a_token_no_client_could_send_is_an_error(tmp_path: Path, token: str) -> None:
    message = error_for(
        tmp_path, SEED_YAML + f"admin:\n  listen_addr: '0.0.0.0:6480'\n  token: {token}\n"
    )
    assert "admin.token" in message and "whitespace" in message


def test_missing_token_file_is_an_error(tmp_path: Path) -> None:
    message = error_for(tmp_path, SEED_YAML + f"admin:\n  token_file: '{tmp_path / 'nope'}'\n")
    assert "admin.token_file: cannot read" in message


def test_anonymize_key_file_read_at_load(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    cfg = load_config(
        write(tmp_path, SEED_YAML + f"observability:\n  anonymize_key_file: '{key_file}'\n"),
        env={},
    )
    assert cfg.observability.anonymize_key == "k3y"


# --------------------------------------------------------------------------- #
# Environment overrides
# --------------------------------------------------------------------------- #


def test_env_overrides_nested(tmp_path: Path) -> None:
    env = {
        "SCRY_LISTEN_ADDR": "127.0.0.1:7000",
        "SCRY_POOL__SIZE": "5",
        "SCRY_POOL__SERVER_RESET_QUERY_ALWAYS": "true",
        "SCRY_TIMEOUTS__QUERY_WAIT_TIMEOUT": "2.5",
        "SCRY_ADMIN__TOKEN": "12345",  # stays a string, not an int
        "SCRY_OBSERVABILITY__EVENTS__SINK": "file",
        "SCRY_OBSERVABILITY__EVENTS__PATH": "/tmp/events",
        "SCRY_ADMIN_TOKEN": "ignored: used by the console",
        "SCRY_CONFIG": "ignored",
        "SCRY_SOMETHING_ELSE": "ignored: not config-like",
        "PATH": "/usr/bin",
    }
    cfg = load_config(write(tmp_path, SEED_YAML), env=env)
    assert cfg.listen_addr == "127.0.0.1:7000"
    assert cfg.pool.size == 5 and cfg.pool.mode == "hybrid"  # sibling keys kept
    assert cfg.pool.server_reset_query_always is True
    assert cfg.timeouts.query_wait_timeout == 2.5
    assert cfg.admin.token == "12345"
    assert cfg.observability.events.path == "/tmp/events"


def test_env_only_config() -> None:
    cfg = load_config(None, env={"SCRY_DATABASE_URL": "postgres://u@db.internal/app"})
    assert cfg.targets()["app"].host == "db.internal"


def test_env_database_map_entry() -> None:
    env = {
        "SCRY_DATABASES__APP__DATABASE_URL": "postgres://u@h/real",
        "SCRY_DATABASES__APP__POOL__SIZE": "7",
    }
    target = load_config(None, env=env).targets()["app"]
    assert target.dbname == "real" and target.pool.size == 7


def test_env_bad_value_names_var(tmp_path: Path) -> None:
    message = error_for(tmp_path, SEED_YAML, env={"SCRY_POOL__SIZE": "lots"})
    assert "pool.size: expected an integer, found 'lots' (set by SCRY_POOL__SIZE)" in message


@pytest.mark.parametrize(
    ("var", "hint"),
    [
        ("SCRY_POOL__SISE", "SCRY_POOL__SIZE"),
        ("SCRY_LISTEN_ADR", "SCRY_LISTEN_ADDR"),
        ("SCRY_POOL__SIZE__X", None),
    ],
)
def test_env_unknown_config_var_refused(tmp_path: Path, var: str, hint: str | None) -> None:
    message = error_for(tmp_path, SEED_YAML, env={var: "1"})
    assert f"{var}: no such config setting" in message
    if hint:
        assert f"did you mean {hint}?" in message


def test_overrides_win_over_env(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, SEED_YAML), env={"SCRY_WORKERS": "2"}, overrides={"workers": 3}
    )
    assert cfg.workers == 3


# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #


def test_targets_percent_decoding_and_defaults() -> None:
    cfg = Config(database_url="postgresql://al%40ice:p%40ss%3Aw%2Frd@db.example.com/my%20db")
    target = cfg.targets()["my db"]
    assert target == DatabaseTarget(
        name="my db",
        hosts=(("db.example.com", 5432),),
        dbname="my db",
        user="al@ice",
        password="p@ss:w/rd",
        params={},
        pool=cfg.pool,
    )


def test_targets_dbname_defaults_to_user_and_host_to_localhost() -> None:
    target = Config(database_url="postgres://bob@").targets()["bob"]
    assert (target.host, target.port, target.dbname, target.password) == (
        "localhost",
        5432,
        "bob",
        None,
    )


def test_targets_unix_socket_and_params() -> None:
    cfg = Config(
        database_url="postgres://u@/app?host=/var/run/postgresql&port=6543&sslmode=require"
        "&application_name=scry"
    )
    target = cfg.targets()["app"]
    assert target.host == "/var/run/postgresql" and target.port == 6543
    assert target.params == {"sslmode": "require", "application_name": "scry"}


def test_targets_ipv6_host() -> None:
    target = Config(database_url="postgres://u@[::1]:5433/app").targets()["app"]
    assert (target.host, target.port) == ("::1", 5433)


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        # libpq's syntax: a list in the authority, a port each or none...
        ("postgres://u@h1:6001,[::1]:6002,h3/app", (("h1", 6001), ("::1", 6002), ("h3", 5432))),
        # ... or in host=, with one port for all or one each.
        ("postgres://u@/app?host=h1,h2&port=6000", (("h1", 6000), ("h2", 6000))),
        ("postgres://u@/app?host=h1,/run/pg&port=6000,6001", (("h1", 6000), ("/run/pg", 6001))),
        ("postgres://u@h:6000/app?host=a,b", (("a", 6000), ("b", 6000))),
    ],
)
def test_targets_host_lists(url: str, hosts: tuple[tuple[str, int], ...]) -> None:
    target = Config(database_url=url).targets()["app"]
    assert target.hosts == hosts
    assert target.load_balance_hosts == "round-robin"  # PgBouncer's default
    assert (target.host, target.port) == (",".join(h for h, _ in hosts), hosts[0][1])


def test_host_choice_parameters_are_not_sent_to_the_server() -> None:
    url = (
        "postgres://u@h1,h2/app?load_balance_hosts=disable&application_name=x"
        "&target_session_attrs=read-write"
    )
    target = Config(database_url=url).targets()["app"]
    assert (target.load_balance_hosts, target.target_session_attrs) == ("disable", "read-write")
    assert target.params == {"application_name": "x"}
    assert Config(database_url="postgres://u@h/app").targets()["app"].target_session_attrs == "any"


def test_databases_map_with_pool_override(tmp_path: Path) -> None:
    text = """\
database_url: "postgres://u@main-host/shared"
pool: {mode: transaction, size: 30, min_size: 2}
databases:
  app:
    database_url: "postgres://app_user:pw@app-host:6000/app_real"
    pool: {size: 4, mode: session, query_wait_timeout: 7.5}
  shared:
    database_url: "postgres://other@other-host/shared_real"
  plain:
    database_url: "postgres://x@h"
"""
    targets = load_config(write(tmp_path, text), env={}).targets()
    assert set(targets) == {"app", "shared", "plain"}
    app_target = targets["app"]
    assert (app_target.host, app_target.port, app_target.dbname) == ("app-host", 6000, "app_real")
    assert app_target.pool.size == 4 and app_target.pool.mode == "session"
    assert app_target.pool.query_wait_timeout == 7.5  # (over timeouts.query_wait_timeout)
    assert targets["shared"].pool.query_wait_timeout is None
    assert app_target.pool.min_size == 2  # inherited
    assert targets["shared"].host == "other-host"  # databases wins on a name clash
    assert targets["shared"].pool.size == 30
    assert targets["plain"].dbname == "x"


def test_pool_override_invalid_after_merge(tmp_path: Path) -> None:
    text = """\
pool: {min_size: 5}
databases:
  app:
    database_url: "postgres://u@h/app"
    pool: {size: 2}
"""
    assert "databases.app.pool.min_size: must not exceed size (2)" in error_for(tmp_path, text)


def test_pool_override_query_wait_timeout_names_the_key(tmp_path: Path) -> None:
    text = """\
databases:
  app:
    database_url: "postgres://u@h/app"
    pool: {query_wait_timeout: soon}
"""
    assert "databases.app.pool.query_wait_timeout" in error_for(tmp_path, text)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mysql://u@h/db", "expected a postgres:// or postgresql:// URL"),
        ("postgres://u@h:notaport/db", "bad port"),
        ("postgres://u@h1:1,h2:2/db?port=1,2,3", "3 ports for 2 hosts"),
        ("postgres://u@h1:1,h2:x/db", "bad port"),
        ("postgres://u@h1,h2/db?load_balance_hosts=fastest", "load_balance_hosts='fastest'"),
        ("postgres://u@h1,h2/db?target_session_attrs=master", "target_session_attrs='master'"),
    ],
)
def test_bad_database_url_names_key(tmp_path: Path, url: str, expected: str) -> None:
    text = f'databases:\n  app:\n    database_url: "{url}"\n'
    message = error_for(tmp_path, text)
    assert "databases.app.database_url:" in message and expected in message


def test_bad_top_level_url_names_key(tmp_path: Path) -> None:
    assert "database_url: expected a postgres://" in error_for(
        tmp_path, 'database_url: "http://x/y"\n'
    )


def test_target_repr_hides_password() -> None:
    target = Config(database_url=f"postgres://u:{SECRET}@h/db").targets()["db"]
    assert SECRET not in repr(target)


# --------------------------------------------------------------------------- #
# Masking
# --------------------------------------------------------------------------- #


def test_errors_do_not_quote_passwords_in_urls(tmp_path: Path) -> None:
    for extra in (
        f'databases:\n  app: "postgres://app:{SECRET}@h/db"\n',  # (a mapping was expected)
        f'databases:\n  app:\n    database_url: "postgres://app:ab/{SECRET}@h/db"\n',
    ):
        message = error_for(tmp_path, 'database_url: "postgres://localhost/db"\n' + extra)
        assert "databases.app" in message and SECRET not in message, message
    text = f'database_url: "postgres://u@h/db?sslpassword={SECRET}&sslmode=require"\n'
    masked = load_config(write(tmp_path, text), env={}).masked_dict()
    assert SECRET not in yaml.safe_dump(masked) and "sslpassword=***" in masked["database_url"]


def test_masked_dict_hides_secrets(tmp_path: Path) -> None:
    text = f"""\
database_url: "postgres://user:{SECRET}@localhost/mydb"
databases:
  app:
    database_url: "postgres://user:{SECRET}@h/app"
  q:
    database_url: "postgres://user@h/q?password={SECRET}"
admin:
  token: "{SECRET}"
observability:
  anonymize_key: "{SECRET}"
auth:
  type: md5
  users:
    - name: alice
      password: "{SECRET}"
"""
    cfg = load_config(write(tmp_path, text), env={})
    dumped = yaml.safe_dump(cfg.masked_dict())
    assert SECRET not in dumped
    masked = cfg.masked_dict()
    assert masked["database_url"] == "postgres://user:***@localhost/mydb"
    assert masked["admin"]["token"] == "***"
    assert masked["auth"]["users"][0] == {"name": "alice", "password": "***"}
    # The config itself keeps the real values.
    assert cfg.admin.token == SECRET


# --------------------------------------------------------------------------- #
# check-config command
# --------------------------------------------------------------------------- #


def test_check_config_ok_and_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCRY_CONFIG", raising=False)
    path = write(tmp_path, SEED_YAML.replace("user:pass", f"user:{SECRET}"))
    result = CliRunner().invoke(app, ["check-config", "-c", str(path)])
    assert result.exit_code == 0, result.output
    assert "config ok" in result.stdout
    assert "user:***@localhost" in result.stdout
    assert SECRET not in result.stdout
    assert yaml.safe_load(result.stdout.replace("config ok", ""))["pool"]["size"] == 100


def test_check_config_of_a_pgbouncer_ini(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What scry makes of a pgbouncer.ini: the effective settings (secrets
    masked) on stdout, what it does not honour on stderr."""
    monkeypatch.delenv("SCRY_CONFIG", raising=False)
    ini = tmp_path / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"app = host=127.0.0.1 port=5432 dbname=app user=app password={SECRET}\n"
        "[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = 6499\nauth_type = trust\n"
        "pool_mode = transaction\ndefault_pool_size = 7\npkt_buf = 8192\n"
    )
    result = CliRunner().invoke(app, ["check-config", "--pgbouncer-config", str(ini)])
    assert result.exit_code == 0, result.output
    assert "not supported: pkt_buf" in result.stderr
    assert result.stdout.endswith("config ok\n") and SECRET not in result.stdout
    effective = yaml.safe_load(result.stdout.replace("config ok", ""))
    assert effective["pool"]["mode"] == "transaction" and effective["pool"]["size"] == 7
    assert effective["listen_addr"] == "127.0.0.1:6499"
    both = ["check-config", "-c", str(write(tmp_path, SEED_YAML)), "--pgbouncer-config", str(ini)]
    result = CliRunner().invoke(app, both)
    assert result.exit_code == 1 and "use either --config or --pgbouncer-config" in result.stderr


def test_check_config_bad_key(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML + "pool_size: 3\n")
    result = CliRunner().invoke(app, ["check-config", "-c", str(path)])
    assert result.exit_code == 1
    assert "pool_size: unknown key" in result.stderr
    assert "Traceback" not in result.output


def test_auth_query_settings(tmp_path: Path) -> None:
    """auth_dbname must name a configured database; auth_query has PgBouncer's default."""
    assert "auth.auth_dbname: no database 'elsewhere' is configured" in error_for(
        tmp_path, SEED_YAML + "auth:\n  auth_user: lookup\n  auth_dbname: elsewhere\n"
    )
    cfg = load_config(write(tmp_path, SEED_YAML + "auth:\n  auth_user: lookup\n"))
    assert cfg.auth is not None and cfg.auth.auth_query.startswith("SELECT rolname, CASE")
    per_database = "databases:\n  other:\n    database_url: postgres://h/o\n"
    assert "databases.other.auth_dbname: no database 'nope' is configured" in error_for(
        tmp_path, SEED_YAML + per_database + "    auth_dbname: nope\n"
    )
    cfg = load_config(write(tmp_path, SEED_YAML + per_database + "    auth_user: lookup\n"))
    assert cfg.targets()["other"].auth_user == "lookup"
    assert cfg.targets()["mydb"].auth_user is None


def test_check_config_reads_the_hba_file(tmp_path: Path) -> None:
    """A rule scry cannot honour fails check-config (as it would fail serve), by key and line."""
    assert "auth.auth_hba_file: is required when auth.type is hba" in error_for(
        tmp_path, SEED_YAML + "auth:\n  type: hba\n"
    )
    hba = write(tmp_path, "host all all 10.0.0.0/8 md5\nhost all all all ldap\n", "hba.conf")
    path = write(tmp_path, SEED_YAML + f"auth:\n  type: hba\n  auth_hba_file: {hba}\n")
    result = CliRunner().invoke(app, ["check-config", "-c", str(path)])
    assert result.exit_code == 1
    assert f"auth.auth_hba_file: {hba} line 2: method 'ldap' is not supported" in result.stderr
    hba.write_text("host all all 10.0.0.0/8 md5\n")
    assert CliRunner().invoke(app, ["check-config", "-c", str(path)]).exit_code == 0


def test_check_config_reads_the_user_name_maps(tmp_path: Path) -> None:
    """A map= the maps file does not define, or a line scry cannot honour in
    it, fails check-config with the key and the line."""
    hba = write(tmp_path, "local all all peer map=staff\n", "hba.conf")
    auth = f"auth:\n  type: hba\n  auth_hba_file: {hba}\n"
    path = write(tmp_path, SEED_YAML + auth)

    def stderr() -> str:
        result = CliRunner().invoke(app, ["check-config", "-c", str(path)])
        return result.stderr if result.exit_code else ""

    assert "line 1 names map=staff, which is not in auth.auth_ident_file (not set)" in stderr()
    ident = write(tmp_path, "# maps\nothers alice app\n", "ident.conf")
    path = write(tmp_path, SEED_YAML + auth + f"  auth_ident_file: {ident}\n")
    assert f"names map=staff, which is not in the user name maps of {ident}" in stderr()
    ident.write_text("# maps\nstaff alice +admins\n")
    assert f"auth.auth_ident_file: {ident} line 2: group names (+admins)" in stderr()
    ident.write_text("# maps\nstaff alice app\n")
    assert stderr() == ""


def test_check_config_reads_scry_config_env(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_YAML)
    result = CliRunner().invoke(app, ["check-config"], env={"SCRY_CONFIG": str(path)})
    assert result.exit_code == 0, result.output


def test_version_and_usage_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("scry ")
    assert runner.invoke(app, ["serve", "--workers", "0"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2
    for command in ("serve", "check-config", "demo"):
        assert runner.invoke(app, [command, "--help"]).exit_code == 0


def test_serve_config_error_and_pgbouncer_flag(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "-c", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 1
    assert result.stderr.startswith("scry: config error:")
    result = runner.invoke(app, ["serve", "--pgbouncer-config", "pgbouncer.ini"])
    assert result.exit_code == 1 and "cannot read pgbouncer.ini" in result.stderr


def test_serve_passes_config_and_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    seen: dict[str, object] = {}

    def fake_run_proxy(config: Config, config_path: str | None) -> int:
        seen.update(config=config, path=config_path)
        return 0

    monkeypatch.setitem(sys.modules, "scry.proxy", types.SimpleNamespace(run_proxy=fake_run_proxy))
    path = write(tmp_path, SEED_YAML)
    result = CliRunner().invoke(app, ["serve", "-c", str(path), "--workers", "3"])
    assert result.exit_code == 0, result.output
    assert seen["path"] == str(path)
    assert isinstance(seen["config"], Config) and seen["config"].workers == 3
