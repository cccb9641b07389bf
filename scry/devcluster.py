"""A throwaway, loopback-only PostgreSQL cluster.

Used by the test suite, by ``scry demo`` and by the benchmarks. A
:class:`DevCluster` runs ``initdb`` into a temporary directory, writes its own
``postgresql.conf`` additions and ``pg_hba.conf``, optionally generates a small
TLS PKI (CA, server certificate, per-user client certificates), starts the
server with ``pg_ctl`` and creates a fixed set of roles exercising each
authentication method::

    with DevCluster() as pg:
        print(pg.dsn())            # postgresql://app:app_pass@127.0.0.1:PORT/app
        print(pg.psql("select 1"))  # "1"

When the current process runs as root, the server (and ``initdb``/``pg_ctl``)
run as the unprivileged OS user ``postgres``, because PostgreSQL refuses to run
as root.

Nothing here depends on pytest or on a PostgreSQL driver: setup SQL goes
through the ``psql`` client binary.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

__all__ = [
    "USERS",
    "DevCluster",
    "DevClusterError",
    "find_pg_bindir",
]

log = logging.getLogger(__name__)

#: Passwords of the password-authenticated roles created in every cluster.
#: ``postgres`` (trust) and ``cert_user`` (client certificate) have none.
USERS: dict[str, str] = {
    "trust_user": "trust_pass",
    "md5_user": "md5_pass",
    "scram_user": "scram_pass",
    "app": "app_pass",
}

#: OS user that runs the server when we are root.
PG_OS_USER = "postgres"

START_TIMEOUT = 60

_HBA_CONF = """\
# Written by scry.devcluster; loopback only.
# TYPE   DATABASE USER        ADDRESS         METHOD
local    all      all                         trust
local    replication postgres                 trust
host     all      postgres    127.0.0.1/32    trust
host     all      trust_user  127.0.0.1/32    trust
host     all      md5_user    127.0.0.1/32    md5
host     all      scram_user  127.0.0.1/32    scram-sha-256
hostssl  all      cert_user   127.0.0.1/32    cert
host     all      all         127.0.0.1/32    scram-sha-256
"""


class DevClusterError(RuntimeError):
    """The development cluster could not be set up, started or queried."""


# ---------------------------------------------------------------------------
# Locating binaries
# ---------------------------------------------------------------------------


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name)) or (0,)


def find_pg_bindir() -> Path:
    """Return the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    ``initdb`` on ``PATH`` wins (symlinks resolved, so a Debian
    ``/usr/local/bin/initdb -> /usr/lib/postgresql/15/bin/initdb`` yields the
    real directory); otherwise the newest ``/usr/lib/postgresql/*/bin``.
    """
    on_path = shutil.which("initdb")
    if on_path:
        real = Path(os.path.realpath(on_path)).parent
        if all((real / b).exists() for b in ("pg_ctl", "postgres")):
            return real
        # initdb found, but its siblings are elsewhere on PATH: fine as long
        # as all three are reachable.
        if shutil.which("pg_ctl") and shutil.which("postgres"):
            return Path(on_path).parent
    candidates = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").exists()),
        key=_version_key,
    )
    if candidates:
        return candidates[-1]
    raise DevClusterError(
        "PostgreSQL server binaries (initdb) not found; install the postgresql package"
    )


_ports_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on, never handed out before by this process:
    a port is not taken until its server binds it, and two picks in a row may
    otherwise get the same one (a proxy and its admin API, say)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


def _conf_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# ---------------------------------------------------------------------------
# TLS material
# ---------------------------------------------------------------------------


class _Pki:
    """A tiny CA able to issue server and client certificates (PEM files)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca_cert = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        try:
            import cryptography  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            self._backend = "openssl"
            if shutil.which("openssl") is None:
                raise DevClusterError(
                    "TLS requested but neither the 'cryptography' package nor the "
                    "openssl CLI is available (pass ssl=False)"
                ) from None
        else:
            self._backend = "cryptography"

    # -- public ------------------------------------------------------------

    def make_ca(self) -> None:
        if self._backend == "cryptography":
            self._crypto_ca()
        else:
            self._openssl_ca()
        os.chmod(self.ca_key, 0o600)
        os.chmod(self.ca_cert, 0o644)

    def issue(
        self, name: str, cn: str, *, server: bool, dns: Sequence[str] = (), ips: Sequence[str] = ()
    ) -> tuple[Path, Path]:
        cert, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if self._backend == "cryptography":
            self._crypto_issue(cert, key, cn, server=server, dns=dns, ips=ips)
        else:
            self._openssl_issue(cert, key, cn, server=server, dns=dns, ips=ips)
        os.chmod(key, 0o600)
        os.chmod(cert, 0o644)
        return cert, key

    # -- cryptography backend ----------------------------------------------

    def _crypto_ca(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "scry test CA")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        self.ca_key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _crypto_issue(
        self,
        cert_path: Path,
        key_path: Path,
        cn: str,
        *,
        server: bool,
        dns: Sequence[str],
        ips: Sequence[str],
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        os.chmod(key_path, 0o600)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    # -- openssl CLI backend (fallback) --------------------------------------

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise DevClusterError(f"openssl {args[0]} failed: {proc.stderr.strip()}")

    def _openssl_ca(self) -> None:
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "3650", "-subj", "/CN=scry test CA",
            "-keyout", str(self.ca_key), "-out", str(self.ca_cert),
            "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip

    def _openssl_issue(
        self,
        cert_path: Path,
        key_path: Path,
        cn: str,
        *,
        server: bool,
        dns: Sequence[str],
        ips: Sequence[str],
    ) -> None:
        csr = cert_path.with_suffix(".csr")
        ext = cert_path.with_suffix(".ext")
        lines = [
            "basicConstraints=critical,CA:FALSE",
            f"extendedKeyUsage={'serverAuth' if server else 'clientAuth'}",
        ]
        sans = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        self._openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-subj", f"/CN={cn}", "-keyout", str(key_path), "-out", str(csr),
        )  # fmt: skip
        self._openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert),
            "-CAkey", str(self.ca_key), "-CAcreateserial", "-days", "3650",
            "-extfile", str(ext), "-out", str(cert_path),
        )  # fmt: skip
        csr.unlink(missing_ok=True)
        ext.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------


class DevCluster:
    """A disposable PostgreSQL cluster listening on ``127.0.0.1`` only.

    :param base_dir: directory holding the data directory, socket directory,
        TLS files and server log. A fresh temporary directory is created (and
        removed again by :meth:`stop`) when omitted. When running as root the
        directory must be reachable by the ``postgres`` OS user.
    :param port: TCP port; a free one is picked when omitted.
    :param ssl: generate a CA plus server certificate and enable TLS.
    :param extra_conf: additional ``postgresql.conf`` settings (raw values,
        written as ``key = value``; quote strings yourself).
    :param prefix: prefix of the temporary directory name.
    """

    host: str = "127.0.0.1"
    superuser: str = "postgres"

    def __init__(
        self,
        base_dir: str | Path | None = None,
        port: int | None = None,
        ssl: bool = True,
        extra_conf: Mapping[str, str] | None = None,
        *,
        prefix: str = "scry-pg-",
    ) -> None:
        self.bindir = find_pg_bindir()
        self._own_base_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix=prefix)).resolve()
        self._port_given = port is not None
        self.port: int = port if port is not None else free_port(self.host)
        self.ssl = ssl
        self.extra_conf: dict[str, str] = dict(extra_conf or {})
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.tls_dir = self.base_dir / "tls"
        self.log_file = self.base_dir / "postgres.log"
        self.ca_cert: Path | None = self.tls_dir / "ca.crt" if ssl else None
        self.server_cert: Path | None = self.tls_dir / "server.crt" if ssl else None
        self.server_key: Path | None = self.tls_dir / "server.key" if ssl else None
        self.pg_stat_statements = False
        self._pki: _Pki | None = None
        self._client_certs: dict[str, tuple[Path, Path]] = {}
        self._initialized = False
        self._started = False
        self._removed = False
        # Who runs the server: ourselves, or the postgres OS user when root.
        self._as_root = os.geteuid() == 0
        if self._as_root:
            try:
                pw = pwd.getpwnam(PG_OS_USER)
            except KeyError:
                raise DevClusterError(
                    f"running as root but OS user {PG_OS_USER!r} does not exist; "
                    "PostgreSQL refuses to run as root"
                ) from None
            self._uid, self._gid = pw.pw_uid, pw.pw_gid
        else:
            self._uid, self._gid = os.geteuid(), os.getegid()

    # -- context manager -----------------------------------------------------

    def __enter__(self) -> DevCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._started else "stopped"
        return f"<DevCluster {self.host}:{self.port} {self.base_dir} {state}>"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Initialise (first time only), start the server and create roles."""
        if self._started:
            return
        if self._removed:
            raise DevClusterError("cluster directory was removed by stop(); create a new one")
        try:
            if not self._initialized:
                self._initdb()
            self._start_server()
            if not self._initialized:
                self._bootstrap_sql()
                self._initialized = True
        except BaseException:
            self.stop()
            raise

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (idempotent) and remove ``base_dir`` if we created it."""
        if self.data_dir.joinpath("postmaster.pid").exists():
            proc = self._run_pg(
                [str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode, "-w"],
                check=False,
            )
            if proc.returncode != 0:
                log.warning("pg_ctl stop failed: %s", (proc.stdout + proc.stderr).strip())
                if mode != "immediate":
                    self._run_pg(
                        [str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir)]
                        + ["-m", "immediate", "-w"],
                        check=False,
                    )
        self._started = False
        if self._own_base_dir and not self._removed and self.base_dir.exists():
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self._removed = True

    def standby(self) -> DevCluster:
        """A hot standby of this running cluster, streaming from it and started
        on a port of its own (for tests of primary/standby choices); stop() it
        before this one."""
        replica = DevCluster(ssl=False, prefix="scry-pg-standby-")
        os.chmod(replica.base_dir, 0o755)
        self._chown(replica.base_dir)
        replica.socket_dir.mkdir(mode=0o755)
        self._chown(replica.socket_dir)
        self._run_pg(
            [
                str(self.bindir / "pg_basebackup"), "-D", str(replica.data_dir), "-R",
                "-X", "stream", "-h", str(self.socket_dir), "-p", str(self.port),
                "-U", self.superuser, "--no-sync", "--checkpoint=fast",
            ],
            error="pg_basebackup failed",
        )  # fmt: skip
        replica._set_conf("port", str(replica.port))
        replica._set_conf("unix_socket_directories", _conf_quote(str(replica.socket_dir)))
        replica._set_conf("ssl", "off")
        replica._initialized = True
        try:
            replica._start_server()
        except BaseException:
            replica.stop()
            raise
        return replica

    def restart(self, mode: str = "fast") -> None:
        """Restart the server in place (data directory kept)."""
        if not self._initialized:
            self.start()
            return
        self._run_pg(
            [str(self.bindir / "pg_ctl"), "restart", "-D", str(self.data_dir)]
            + ["-m", mode, "-w", "-t", str(START_TIMEOUT), "-l", str(self.log_file)],
            error="pg_ctl restart failed",
        )
        self._started = True

    def is_running(self) -> bool:
        """Whether ``pg_ctl status`` reports a live server."""
        if not self.data_dir.exists():
            return False
        proc = self._run_pg(
            [str(self.bindir / "pg_ctl"), "status", "-D", str(self.data_dir)], check=False
        )
        return proc.returncode == 0

    # -- connection strings ----------------------------------------------------

    def dsn(
        self,
        user: str = "app",
        password: str | None = None,
        dbname: str = "app",
        *,
        host: str | None = None,
        port: int | None = None,
        **params: Any,
    ) -> str:
        """A ``postgresql://`` URL for libpq, psycopg and asyncpg.

        ``password`` defaults from :data:`USERS`; ``host``/``port`` default to
        the cluster's (override them to point at a proxy); ``params`` become
        query parameters (e.g. ``sslmode="require"``).
        """
        return self._url("postgresql", user, password, dbname, host, port, params)

    def url(
        self,
        user: str = "app",
        password: str | None = None,
        dbname: str = "app",
        *,
        host: str | None = None,
        port: int | None = None,
        **params: Any,
    ) -> str:
        """Same as :meth:`dsn` but with the ``postgres://`` scheme."""
        return self._url("postgres", user, password, dbname, host, port, params)

    def _url(
        self,
        scheme: str,
        user: str,
        password: str | None,
        dbname: str,
        host: str | None,
        port: int | None,
        params: Mapping[str, Any],
    ) -> str:
        if password is None:
            password = USERS.get(user)
        auth = quote(user, safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        url = f"{scheme}://{auth}@{host or self.host}:{port or self.port}/{quote(dbname, safe='')}"
        if params:
            url += "?" + urlencode({k: str(v) for k, v in params.items()})
        return url

    def client_cert(self, user: str) -> tuple[Path, Path]:
        """``(cert_path, key_path)`` of a client certificate with ``CN=user``.

        Created on first use and cached; files are owned by the current
        process (libpq requires the key to be private to its reader).
        """
        if not self.ssl:
            raise DevClusterError("client certificates need a cluster started with ssl=True")
        if user not in self._client_certs:
            pki = self._pki or _Pki(self.tls_dir)
            self._pki = pki
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", user)
            self._client_certs[user] = pki.issue(f"client-{safe}", user, server=False)
        return self._client_certs[user]

    # -- SQL -------------------------------------------------------------------

    def psql(self, sql: str, user: str = "postgres", dbname: str = "app") -> str:
        """Run ``sql`` with ``psql -At`` over TCP and return its stdout.

        Statements are fed on stdin, so several may be given (each runs in its
        own transaction, allowing e.g. ``CREATE DATABASE``). Raises
        :class:`DevClusterError` on any error.
        """
        env = dict(os.environ)
        for var in ("PGSERVICE", "PGSSLMODE", "PGOPTIONS", "PGHOSTADDR", "PGPASSFILE"):
            env.pop(var, None)
        env["PGCONNECT_TIMEOUT"] = "10"
        password = USERS.get(user)
        if password is not None:
            env["PGPASSWORD"] = password
        else:
            env.pop("PGPASSWORD", None)
        cmd = [
            self._psql_bin(),
            "-X", "-At", "-q", "-v", "ON_ERROR_STOP=1",
            "-h", self.host, "-p", str(self.port), "-U", user, "-d", dbname,
            "-f", "-",
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, input=sql, capture_output=True, text=True, env=env, check=False, timeout=120
        )
        if proc.returncode != 0:
            raise DevClusterError(f"psql failed (user={user} db={dbname}): {proc.stderr.strip()}")
        return proc.stdout.rstrip("\n")

    # -- internals ---------------------------------------------------------------

    def _psql_bin(self) -> str:
        local = self.bindir / "psql"
        if local.exists():
            return str(local)
        found = shutil.which("psql")
        if not found:
            raise DevClusterError("psql client binary not found")
        return found

    def _run_pg(
        self,
        cmd: list[str],
        *,
        check: bool = True,
        error: str = "command failed",
        timeout: float = START_TIMEOUT + 30,
    ) -> subprocess.CompletedProcess[str]:
        """Run a server-side binary as the server's OS user."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k not in ("LANG",)}
        env["LC_ALL"] = "C"
        kwargs: dict[str, Any] = {}
        if self._as_root:
            pw = pwd.getpwuid(self._uid)
            kwargs.update(user=self._uid, group=self._gid, extra_groups=[])
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        log.debug("running %s", " ".join(cmd))
        try:
            proc = subprocess.run(
                cmd,
                cwd=self.base_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
                timeout=timeout,
                start_new_session=True,  # keep Ctrl-C of the caller away from postgres
                **kwargs,
            )
        except subprocess.TimeoutExpired as e:
            raise DevClusterError(f"{error}: timed out after {timeout}s{self._log_tail()}") from e
        if check and proc.returncode != 0:
            output = (proc.stdout + proc.stderr).strip()
            raise DevClusterError(f"{error} (exit {proc.returncode}): {output}{self._log_tail()}")
        return proc

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        tail = "\n".join(text.splitlines()[-lines:])
        return f"\n--- tail of {self.log_file} ---\n{tail}" if tail else ""

    def _chown(self, path: Path) -> None:
        if self._as_root:
            os.chown(path, self._uid, self._gid)

    def _initdb(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._chown(self.base_dir)
        if self._own_base_dir:
            os.chmod(self.base_dir, 0o755)  # mkdtemp gives 0700
        self.socket_dir.mkdir(mode=0o755, exist_ok=True)
        self._chown(self.socket_dir)
        log.info("initdb %s (bindir %s)", self.data_dir, self.bindir)
        self._run_pg(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.data_dir),
                "-A", "trust", f"--username={self.superuser}",
                "-E", "UTF8", "--locale=C", "--no-sync",
            ],
            error="initdb failed",
        )  # fmt: skip
        conf: dict[str, str] = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": _conf_quote(str(self.socket_dir)),
            "max_connections": "300",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "log_min_messages": "warning",
            "logging_collector": "off",
        }
        self.pg_stat_statements = self._has_pg_stat_statements()
        if self.pg_stat_statements:
            conf["shared_preload_libraries"] = "'pg_stat_statements'"
        if self.ssl:
            self._make_tls()
            assert self.server_cert and self.server_key and self.ca_cert
            conf.update(
                ssl="on",
                ssl_cert_file=_conf_quote(str(self.server_cert)),
                ssl_key_file=_conf_quote(str(self.server_key)),
                ssl_ca_file=_conf_quote(str(self.ca_cert)),
            )
        conf.update(self.extra_conf)
        conf_path = self.data_dir / "postgresql.conf"
        with conf_path.open("a") as f:
            f.write("\n# --- added by scry.devcluster ---\n")
            for key, value in conf.items():
                f.write(f"{key} = {value}\n")
        (self.data_dir / "pg_hba.conf").write_text(_HBA_CONF)
        # postgresql.conf and pg_hba.conf already belong to the server user.

    def _make_tls(self) -> None:
        self.tls_dir.mkdir(mode=0o755, exist_ok=True)
        self._chown(self.tls_dir)
        pki = _Pki(self.tls_dir)
        self._pki = pki
        pki.make_ca()
        cert, key = pki.issue(
            "server", "localhost", server=True, dns=["localhost"], ips=["127.0.0.1"]
        )
        assert cert == self.server_cert and key == self.server_key
        for path in (cert, key, pki.ca_cert):
            self._chown(path)  # the server key must belong to the server user

    def _has_pg_stat_statements(self) -> bool:
        sharedirs: list[Path] = []
        libdirs: list[Path] = []
        pg_config = self.bindir / "pg_config"
        if pg_config.exists():
            proc = subprocess.run(
                [str(pg_config), "--sharedir", "--pkglibdir"],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode == 0 and len(proc.stdout.split()) == 2:
                share, lib = proc.stdout.split()
                sharedirs.append(Path(share))
                libdirs.append(Path(lib))
        # Debian layout: /usr/lib/postgresql/NN/{bin,lib} + /usr/share/postgresql/NN
        libdirs.append(self.bindir.parent / "lib")
        major = self.bindir.parent.name
        sharedirs += [Path("/usr/share/postgresql") / major, self.bindir.parent / "share"]
        has_control = any(
            (d / "extension" / "pg_stat_statements.control").exists() for d in sharedirs
        )
        has_lib = any((d / "pg_stat_statements.so").exists() for d in libdirs)
        if not (has_control and has_lib):
            log.info("pg_stat_statements not available; not preloading it")
        return has_control and has_lib

    def _start_server(self) -> None:
        attempts = 1 if self._port_given else 3
        for attempt in range(attempts):
            try:
                self._run_pg(
                    [
                        str(self.bindir / "pg_ctl"), "start", "-w",
                        "-t", str(START_TIMEOUT), "-D", str(self.data_dir),
                        "-l", str(self.log_file),
                    ],
                    error=f"PostgreSQL failed to start on {self.host}:{self.port}",
                )  # fmt: skip
            except DevClusterError:
                # Someone grabbed our port between choosing and binding it.
                if attempt + 1 < attempts and "already in use" in self._log_tail(10):
                    self.port = free_port(self.host)
                    self._set_conf("port", str(self.port))
                    log.info("port collision; retrying on %d", self.port)
                    continue
                raise
            self._started = True
            log.info("PostgreSQL running on %s:%d (%s)", self.host, self.port, self.base_dir)
            return

    def _set_conf(self, key: str, value: str) -> None:
        conf_path = self.data_dir / "postgresql.conf"
        with conf_path.open("a") as f:
            f.write(f"{key} = {value}\n")

    def _bootstrap_sql(self) -> None:
        stmts = ["SET password_encryption = 'md5'"]
        stmts.append(f"CREATE ROLE md5_user LOGIN PASSWORD {_sql_literal(USERS['md5_user'])}")
        stmts.append("SET password_encryption = 'scram-sha-256'")
        for user in ("trust_user", "scram_user", "app"):
            stmts.append(f"CREATE ROLE {user} LOGIN PASSWORD {_sql_literal(USERS[user])}")
        stmts.append("CREATE ROLE cert_user LOGIN")
        stmts.append("GRANT pg_signal_backend, pg_read_all_stats TO app")
        stmts.append("CREATE DATABASE app OWNER app")
        others = "trust_user, md5_user, scram_user, cert_user"
        stmts.append(f"GRANT CONNECT, CREATE ON DATABASE app TO app, {others}")
        self.psql(";\n".join(stmts) + ";\n", user=self.superuser, dbname="postgres")

        in_app = [f"GRANT USAGE, CREATE ON SCHEMA public TO app, {others}"]
        if self.pg_stat_statements:
            in_app.append("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        self.psql(";\n".join(in_app) + ";\n", user=self.superuser, dbname="app")
