"""Host-based authentication: ``auth.type: hba`` with ``auth.auth_hba_file``.

The file has pg_hba.conf's format, as PgBouncer's ``auth_hba_file`` does: one
rule per line, ``TYPE DATABASE USER [ADDRESS [MASK]] METHOD``, ``#`` comments,
double quotes around names with spaces or commas (``""`` inside them is a
quote; a quoted keyword is a plain name), comma-separated lists, ``@file``
lists of names (relative to the HBA file), and a trailing backslash
continuing a line. The first rule that matches the connection decides; when
none does, the connection is rejected, as PostgreSQL does.

What a pooler can honour:

* types ``local`` (the Unix socket), ``host``, ``hostssl``, ``hostnossl``;
* databases ``all``, ``sameuser`` and names; users ``all`` and names;
* addresses ``all``, ``ADDR/BITS`` and ``ADDR MASK``, IPv4 and IPv6 (an
  IPv4-mapped IPv6 client matches IPv4 rules);
* methods ``trust``, ``reject``, ``md5``, ``scram-sha-256``, ``password``
  (cleartext), ``cert`` (the TLS client certificate's CN is the user) and
  ``peer`` (``local`` only: the connecting OS user is the user); ``map=NAME``
  after ``peer`` or ``cert`` names a user name map (scry.ident).

Anything else (host names, ``samehost``, ``+group``, ``replication``,
``ident``, ``ldap``, other options after the method) is refused when the file is
read, with its line, so a rule never silently means less than it says.
No I/O but reading the files; the proxy calls :meth:`HbaRules.method_for`.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import NamedTuple

from scry.config import ConfigError
from scry.userlist import read_quoted

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

CONNECTION_TYPES = ("local", "host", "hostssl", "hostnossl")
#: Methods as written in the file -> scry's names for them (auth.type's).
METHODS = {
    "trust": "trust",
    "reject": "reject",
    "md5": "md5",
    "scram-sha-256": "scram-sha-256",
    "password": "plain",
    "cert": "cert",
    "peer": "peer",
}
_UNSUPPORTED_NAMES = {
    "replication": "replication connections are not supported by scry",
    "samerole": "samerole needs role membership, which scry does not know",
    "samegroup": "samegroup needs role membership, which scry does not know",
}


class HbaError(ValueError):
    """A line scry cannot honour: the message names the file and the line."""


class Token(NamedTuple):
    text: str
    quoted: bool


@dataclass(frozen=True, slots=True)
class HbaRule:
    line: int
    conn_type: str
    databases: frozenset[str]
    all_databases: bool
    sameuser: bool
    users: frozenset[str]
    all_users: bool
    network: IPNetwork | None  # None: local, or address "all"
    method: str  # a value of METHODS
    user_map: str | None = None  # peer and cert: map=NAME of auth.auth_ident_file (scry.ident)

    def matches(
        self, local: bool, tls: bool, address: IPAddress | None, database: str, user: str
    ) -> bool:
        if (self.conn_type == "local") != local:
            return False
        if (self.conn_type == "hostssl" and not tls) or (self.conn_type == "hostnossl" and tls):
            return False
        network = self.network
        if network is not None and (
            address is None or address.version != network.version or address not in network
        ):
            return False
        if not (
            self.all_databases or (self.sameuser and database == user) or database in self.databases
        ):
            return False
        return self.all_users or user in self.users


class HbaRules:
    """The rules of one HBA file, in order."""

    def __init__(self, rules: list[HbaRule]) -> None:
        self.rules = rules

    def method_for(
        self, *, local: bool, tls: bool, host: str | None, database: str, user: str
    ) -> tuple[str, HbaRule | None]:
        """The method for this connection and the rule that chose it;
        ``("reject", None)`` when no rule matches."""
        address = _client_address(host) if not local else None
        for rule in self.rules:
            if rule.matches(local, tls, address, database, user):
                return rule.method, rule
        return "reject", None


def load_hba(path: str) -> HbaRules:
    """Read and parse an HBA file; raises OSError or HbaError."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return HbaRules(parse_hba(text, path))


def parse_hba(text: str, path: str = "<hba>") -> list[HbaRule]:
    rules = []
    for number, line in logical_lines(text):
        fields = split_fields(line, path, number)
        if fields:
            rules.append(_rule(fields, path, number))
    return rules


def _client_address(host: str | None) -> IPAddress | None:
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # (no IPv6 zone)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) per record, backslash continuations joined."""
    records: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1] + " ")
            continue
        pending.append(raw)
        records.append((start, "".join(pending)))
        pending = []
    if pending:
        records.append((start, "".join(pending)))
    return records


def split_fields(line: str, path: str, number: int) -> list[list[Token]]:
    """Whitespace-separated fields, each a comma-separated list of tokens."""
    fields: list[list[Token]] = []
    current: list[Token] | None = None
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in " \t\r\n":
            i += 1
            continue
        if c == "#":
            break
        if c == '"':
            try:
                text, i = read_quoted(line, i, "name", f"{path} line {number}")
            except ConfigError as exc:
                raise HbaError(str(exc)) from None
            token = Token(text, True)
        else:
            j = i
            while j < n and line[j] not in ' \t\r\n,#"':
                j += 1
            if j == i:
                raise HbaError(f"{path} line {number}: a list item is missing before ','")
            token, i = Token(line[i:j], False), j
        if current is None:
            current = []
            fields.append(current)
        current.append(token)
        k = i
        while k < n and line[k] in " \t":
            k += 1
        if k < n and line[k] == ",":
            i = k + 1  # the list goes on in this field
        else:
            current = None
    return fields


def _rule(fields: list[list[Token]], path: str, number: int) -> HbaRule:
    where = f"{path} line {number}"

    def word(field: list[Token], what: str) -> str:
        if len(field) != 1 or field[0].quoted:
            raise HbaError(f"{where}: expected one {what}, found {_show(field)}")
        return field[0].text

    conn_type = word(fields[0], "connection type")
    if conn_type not in CONNECTION_TYPES:
        raise HbaError(
            f"{where}: connection type {conn_type!r} is not supported "
            f"(use {', '.join(CONNECTION_TYPES)})"
        )
    local = conn_type == "local"
    need = 4 if local else 5
    if len(fields) < need:
        raise HbaError(f"{where}: expected TYPE DATABASE USER{'' if local else ' ADDRESS'} METHOD")
    databases, all_databases, sameuser = _names(fields[1], True, path, where)
    users, all_users, _ = _names(fields[2], False, path, where)
    network = None
    rest = fields[3:]
    if not local:
        network, rest = _address(rest, where)
    if not rest:
        raise HbaError(f"{where}: the method is missing")
    written = word(rest[0], "method")
    method = METHODS.get(written)
    if method is None:
        raise HbaError(f"{where}: method {written!r} is not supported (use {', '.join(METHODS)})")
    user_map = None
    for option in rest[1:]:
        text = _show(option)
        if len(option) != 1 or option[0].quoted or not text.startswith("map=") or text == "map=":
            raise HbaError(f"{where}: options after the method are not supported "
                           f"(but map=NAME for peer and cert): {text}")  # fmt: skip
        if method not in ("peer", "cert"):
            raise HbaError(f"{where}: map= is only for peer and cert, not {written}")
        user_map = text[len("map=") :]
    if method == "peer" and not local:
        raise HbaError(f"{where}: peer is only for local (Unix socket) connections")
    return HbaRule(number, conn_type, databases, all_databases, sameuser, users, all_users,
                   network, method, user_map)  # fmt: skip


def _names(
    field: list[Token], is_database: bool, path: str, where: str
) -> tuple[frozenset[str], bool, bool]:
    names: set[str] = set()
    every = same = False
    for token in field:
        text = token.text
        if token.quoted:
            names.add(text)
        elif text == "all":
            every = True
        elif is_database and text == "sameuser":
            same = True
        elif is_database and text in _UNSUPPORTED_NAMES:
            raise HbaError(f"{where}: {_UNSUPPORTED_NAMES[text]}")
        elif not is_database and text.startswith("+"):
            raise HbaError(f"{where}: group names ({text}) need role membership, "
                           "which scry does not know")  # fmt: skip
        elif text.startswith("@"):
            names.update(_names_file(text[1:], path, where))
        else:
            names.add(text)
    return frozenset(names), every, same


def _names_file(name: str, path: str, where: str) -> list[str]:
    full = os.path.join(os.path.dirname(path), name)
    try:
        with open(full, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise HbaError(f"{where}: cannot read {full}: {exc.strerror}") from None
    names = []
    for number, line in logical_lines(text):
        for field in split_fields(line, full, number):
            names.extend(token.text for token in field)
    return names


def _address(fields: list[list[Token]], where: str) -> tuple[IPNetwork | None, list[list[Token]]]:
    field = fields[0]
    if len(field) != 1 or field[0].quoted:
        raise HbaError(f"{where}: expected one address, found {_show(field)}")
    text = field[0].text
    if text == "all":
        return None, fields[1:]
    try:
        if "/" in text:
            return ipaddress.ip_network(text, strict=False), fields[1:]
        address = ipaddress.ip_address(text)
    except ValueError:
        raise HbaError(
            f"{where}: {text!r} is not an IP address or network "
            "(host names, samehost and samenet are not supported)"
        ) from None
    mask = _show(fields[1])  # (the rule has a field after the address: checked)
    try:
        return ipaddress.ip_network(f"{address}/{mask}", strict=False), fields[2:]
    except ValueError:
        raise HbaError(
            f"{where}: {mask!r} is not a netmask for {text} (follow the address with "
            f"one, or write it as {text}/BITS)"
        ) from None


def _show(field: list[Token]) -> str:
    return ",".join(f'"{t.text}"' if t.quoted else t.text for t in field) or "nothing"
