"""User name maps: ``auth.auth_ident_file``, in pg_ident.conf's format.

A ``peer`` or ``cert`` rule of the HBA file (scry.hba) that says
``map=NAME`` lets a connection in as a database user when the map has a line
for the name the connection proves (the OS user of a Unix-socket client, the
CN of a client certificate) and that database user, as PostgreSQL does. One
line per record, ``MAP SYSTEM-USERNAME DATABASE-USERNAME``, with pg_hba.conf's
quoting, comments and continuations:

* a system user name that starts with ``/`` is a regular expression (Python's
  syntax, searched for as PostgreSQL searches, so anchor it with ``^``/``$``),
  and ``\\1`` in the database user name stands for what its first group
  matched;
* the database user name ``all`` (not quoted) stands for every user.

PgBouncer reads literal names and ``all`` only; scry reads PostgreSQL's
regular expressions too, so an existing pg_ident.conf can serve both.
What needs more than a pooler knows (``include`` directives, ``+group``,
regular expressions as the database user name) is refused when the file is
read, with its line. No I/O but reading the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scry.hba import HbaError, Token, logical_lines, split_fields

_INCLUDES = ("include", "include_if_exists", "include_dir")


@dataclass(frozen=True, slots=True)
class MapLine:
    line: int
    system_user: str | re.Pattern[str]
    database_user: str
    every_database_user: bool  # the database user field was the keyword all


class UserMaps:
    """The user name maps of one file, by map name, lines in file order."""

    def __init__(self, maps: dict[str, list[MapLine]]) -> None:
        self.maps = maps

    def allows(self, map_name: str, system_user: str, database_user: str) -> bool:
        """Whether ``map_name`` lets ``system_user`` log in as ``database_user``."""
        for entry in self.maps.get(map_name, ()):
            pattern = entry.system_user
            if isinstance(pattern, str):
                if pattern != system_user:
                    continue
                wanted = entry.database_user
            else:
                found = pattern.search(system_user)
                if found is None:
                    continue
                wanted = entry.database_user
                if "\\1" in wanted:
                    wanted = wanted.replace("\\1", found.group(1) or "", 1)
            if entry.every_database_user or wanted == database_user:
                return True
        return False


def load_user_maps(path: str) -> UserMaps:
    """Read and parse a user name map file; raises OSError or HbaError."""
    with open(path, encoding="utf-8") as f:
        return parse_user_maps(f.read(), path)


def parse_user_maps(text: str, path: str = "<ident>") -> UserMaps:
    maps: dict[str, list[MapLine]] = {}
    for number, line in logical_lines(text):
        fields = split_fields(line, path, number)
        if not fields:
            continue
        name, entry = _map_line(fields, f"{path} line {number}", number)
        maps.setdefault(name, []).append(entry)
    return UserMaps(maps)


def _map_line(fields: list[list[Token]], where: str, number: int) -> tuple[str, MapLine]:
    first = fields[0][0]
    if not first.quoted and first.text in _INCLUDES:
        raise HbaError(f"{where}: {first.text} is not supported")
    if len(fields) != 3:
        raise HbaError(f"{where}: expected MAP SYSTEM-USERNAME DATABASE-USERNAME")
    for field in fields:
        if len(field) != 1:
            raise HbaError(f"{where}: one name per field, found a list")
    name, system, database = (field[0] for field in fields)
    if not database.quoted and database.text.startswith("+"):
        raise HbaError(
            f"{where}: group names ({database.text}) need role membership, which scry does not know"
        )
    if database.text.startswith("/"):
        raise HbaError(f"{where}: a regular expression as the database user name is not supported")
    system_user: str | re.Pattern[str] = system.text
    if system.text.startswith("/"):
        try:
            system_user = re.compile(system.text[1:])
        except re.error as exc:
            raise HbaError(
                f"{where}: invalid regular expression {system.text[1:]!r}: {exc}"
            ) from None
        if "\\1" in database.text and system_user.groups < 1:
            raise HbaError(f"{where}: \\1 in {database.text!r}, but the expression has no group")
    every = database.text == "all" and not database.quoted
    return name.text, MapLine(number, system_user, database.text, every)
