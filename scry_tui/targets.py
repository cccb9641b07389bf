"""Which proxies the console watches: TARGET arguments and the fleet file.

A TARGET is ``http(s)://host:port``, ``host:port`` or
``ssh://[user@]host[:22]/ADMIN_HOST:ADMIN_PORT`` (the console opens the SSH
tunnel itself, see :mod:`scry_tui.tunnel`). With no TARGET the console reads
the fleet file (``~/.config/scry/fleet.yaml``, or ``$SCRY_FLEET``), and
without one it watches ``http://127.0.0.1:6480``.

The fleet file::

    refresh: 2                 # seconds between polls (optional)
    read_only: false           # hide destructive actions (optional)
    ssh_options: ["-i", "~/.ssh/ops"]   # extra `ssh` arguments (optional)
    proxies:
      - name: eu-1
        target: http://10.0.0.5:6480
        token_env: EU1_ADMIN_TOKEN     # or token: ..., or token_file: ...
      - name: us-1
        target: ssh://ops@bastion.example.com/127.0.0.1:6480

``proxies`` may also be a mapping of name to target (a string) or to the
same keys as above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from admin import DEFAULT_TARGET, TOKEN_ENV, parse_target

DEFAULT_FLEET_FILE = Path("~/.config/scry/fleet.yaml")
FLEET_ENV = "SCRY_FLEET"


class TargetError(ValueError):
    """A TARGET or the fleet file is not valid (a user error: exit 1)."""


@dataclass(frozen=True)
class SSHSpec:
    """The parts of an ``ssh://[user@]host[:port]/ADMIN_HOST:ADMIN_PORT`` target."""

    host: str
    admin_host: str
    admin_port: int
    user: str | None = None
    port: int | None = None

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    def __str__(self) -> str:
        port = f":{self.port}" if self.port else ""
        return f"ssh://{self.destination}{port}/{self.admin_host}:{self.admin_port}"


@dataclass(frozen=True)
class Target:
    """One proxy's admin endpoint as the console knows it."""

    name: str
    url: str  # http(s)://host:port; for ssh targets, filled in once the tunnel is up
    token: str | None = None
    ssh: SSHSpec | None = None
    ssh_options: tuple[str, ...] = ()

    @property
    def display(self) -> str:
        return str(self.ssh) if self.ssh else self.url


@dataclass
class Fleet:
    """The targets plus console settings from a fleet file (None: not set there)."""

    targets: list[Target]
    refresh: float | None = None
    read_only: bool | None = None
    source: str = "arguments"
    extra: dict[str, Any] = field(default_factory=dict)


def parse_ssh(target: str) -> SSHSpec:
    """Split an ``ssh://`` TARGET; raises :class:`TargetError` with what is wrong."""
    parts = urlsplit(target)
    if parts.scheme != "ssh" or not parts.hostname:
        raise TargetError(f"not an ssh:// target: {target!r}")
    remote = parts.path.lstrip("/")
    host, sep, port = remote.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TargetError(
            f"ssh target needs the admin address after the host: "
            f"ssh://[user@]host[:22]/ADMIN_HOST:ADMIN_PORT, not {target!r}"
        )
    try:
        ssh_port = parts.port
    except ValueError as exc:
        raise TargetError(f"bad ssh port in {target!r}") from exc
    return SSHSpec(
        host=parts.hostname,
        admin_host=host.strip("[]"),
        admin_port=int(port),
        user=parts.username,
        port=ssh_port,
    )


def make_target(
    text: str,
    *,
    name: str | None = None,
    token: str | None = None,
    ssh_options: tuple[str, ...] = (),
) -> Target:
    """A :class:`Target` from a TARGET string; the name defaults to its host:port."""
    text = text.strip()
    if text.startswith("ssh://"):
        spec = parse_ssh(text)
        return Target(
            name=name or spec.host,
            url="",
            token=token,
            ssh=spec,
            ssh_options=ssh_options,
        )
    try:
        url = parse_target(text)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    return Target(name=name or urlsplit(url).netloc, url=url, token=token)


def _token_from(entry: dict[str, Any], where: str) -> str | None:
    if entry.get("token"):
        return str(entry["token"])
    if entry.get("token_env"):
        return os.environ.get(str(entry["token_env"])) or None
    if entry.get("token_file"):
        path = Path(str(entry["token_file"])).expanduser()
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            raise TargetError(f"{where}: cannot read token_file {path}: {exc}") from None
    return None


def load_fleet(path: Path) -> Fleet:
    """Read a fleet file; raises :class:`TargetError` naming the file and the entry."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise TargetError(f"cannot read fleet file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise TargetError(f"fleet file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TargetError(f"fleet file {path}: expected a mapping with `proxies:`")
    raw = data.get("proxies", data.get("targets"))
    if isinstance(raw, dict):
        entries: list[Any] = [
            {"name": k, **(v if isinstance(v, dict) else {"target": v})} for k, v in raw.items()
        ]
    elif isinstance(raw, list):
        entries = raw
    else:
        raise TargetError(f"fleet file {path}: `proxies:` must be a list or a mapping")
    ssh_options = tuple(str(o) for o in data.get("ssh_options") or ())
    targets: list[Target] = []
    for i, entry in enumerate(entries):
        where = f"fleet file {path}: proxies[{i}]"
        if isinstance(entry, str):
            entry = {"target": entry}
        if not isinstance(entry, dict) or not entry.get("target"):
            raise TargetError(f"{where}: needs `target:`")
        options = ssh_options + tuple(str(o) for o in entry.get("ssh_options") or ())
        try:
            targets.append(
                make_target(
                    str(entry["target"]),
                    name=str(entry["name"]) if entry.get("name") else None,
                    token=_token_from(entry, where),
                    ssh_options=options,
                )
            )
        except TargetError as exc:
            raise TargetError(f"{where}: {exc}") from None
    if not targets:
        raise TargetError(f"fleet file {path} lists no proxies")
    refresh = data.get("refresh")
    read_only = data.get("read_only")
    return Fleet(
        targets=_unique_names(targets),
        refresh=float(refresh) if refresh is not None else None,
        read_only=bool(read_only) if read_only is not None else None,
        source=str(path),
    )


def _unique_names(targets: list[Target]) -> list[Target]:
    seen: dict[str, int] = {}
    out: list[Target] = []
    for target in targets:
        n = seen.get(target.name, 0)
        seen[target.name] = n + 1
        if n:
            target = Target(
                f"{target.name}#{n + 1}", target.url, target.token, target.ssh, target.ssh_options
            )
        out.append(target)
    return out


def resolve_targets(
    args: list[str] | None,
    *,
    token: str | None = None,
    fleet_file: Path | None = None,
    ssh_options: tuple[str, ...] = (),
) -> Fleet:
    """The console's targets: TARGET arguments, else the fleet file, else the default.

    ``token`` (``--token`` or ``$SCRY_ADMIN_TOKEN``) applies to TARGET
    arguments; fleet-file entries carry their own.
    """
    token = token or os.environ.get(TOKEN_ENV) or None
    if fleet_file is not None or (not args and os.environ.get(FLEET_ENV)):
        path = (fleet_file or Path(os.environ[FLEET_ENV])).expanduser()
        fleet = load_fleet(path)
        if args:  # both: the arguments come first, then the fleet
            extra = [make_target(a, token=token, ssh_options=ssh_options) for a in args]
            fleet.targets = _unique_names(extra + fleet.targets)
        return fleet
    if args:
        targets = [make_target(a, token=token, ssh_options=ssh_options) for a in args]
        return Fleet(targets=_unique_names(targets))
    default_file = DEFAULT_FLEET_FILE.expanduser()
    if default_file.exists():
        return load_fleet(default_file)
    return Fleet(targets=[make_target(DEFAULT_TARGET, token=token)], source="default")
