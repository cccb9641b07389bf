"""PgBouncer compatibility: run scry from a pgbouncer.ini, with PgBouncer's console.

- :mod:`scry.pgbouncer.ini` reads a pgbouncer.ini by PgBouncer's rules and
  turns it into a scry :class:`~scry.config.Config` plus the list of settings
  scry does not support (each reported once, by name);
- :mod:`scry.pgbouncer.console` is the ``pgbouncer`` admin database (SHOW
  POOLS, PAUSE, RELOAD, ...) spoken over the PostgreSQL simple query protocol;
  its docstring maps the modules it is made of (session, dispatch, views,
  stats, commands, results, state);
- :mod:`scry.pgbouncer.cli` is the ``scry-pgbouncer`` command, a drop-in for
  the ``pgbouncer`` binary's command line.

docs/migrating-from-pgbouncer.md says, key by key and command by command, what
differs.
"""

from __future__ import annotations

from scry.pgbouncer.ini import IniError, PgbouncerIni, load_pgbouncer_config, parse_ini

__all__ = ["IniError", "PgbouncerIni", "load_pgbouncer_config", "parse_ini"]

#: The PgBouncer release whose settings and console this package follows.
PGBOUNCER_VERSION = "1.25.0"
