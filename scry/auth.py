"""Who may log in to scry, and with which secret.

Users come from ``auth.users``, ``auth.auth_file`` (PgBouncer's userlist.txt)
and, when there is no ``auth:`` section at all, from the credentials inside
``database_url``/``databases``: the application's old connection string keeps
working and nothing is open by default. ``trust`` must be chosen explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from scry.config import Config, ConfigError, DatabaseTarget
from scry.hba import HbaError, HbaRules, load_hba
from scry.ident import UserMaps, load_user_maps
from scry.protocol.auth import SCRAM_MIN_ITERATIONS
from scry.userlist import load_userlist

#: Client auth methods a stored secret must answer.
PASSWORD_METHODS = ("md5", "scram-sha-256", "plain")


@dataclass(frozen=True)
class AuthPolicy:
    method: str
    users: dict[str, str]  # user name -> stored secret (plain, md5 or SCRAM)
    hba: HbaRules | None = None  # method "hba": the rules that choose each login's method
    user_maps: UserMaps | None = None  # the maps the rules' map= options name
    auth_user: str | None = None  # who runs auth_query for users with no secret here
    scram_iterations: int = SCRAM_MIN_ITERATIONS  # of SCRAM secrets made from plaintext ones

    @classmethod
    def from_config(cls, config: Config) -> AuthPolicy:
        users: dict[str, str] = {}
        auth = config.auth
        if auth is None:
            for target in config.targets().values():
                if target.user and target.password is not None:
                    users.setdefault(target.user, target.password)
            return cls("scram-sha-256", users)
        if auth.auth_file:
            try:
                users.update(load_userlist(auth.auth_file))
            except OSError as exc:
                raise ConfigError(f"auth.auth_file: cannot read {auth.auth_file}: {exc}") from exc
        for entry in auth.users:
            if entry.password is not None:
                users[entry.name] = entry.password
        hba = None
        if auth.type == "hba":
            assert auth.auth_hba_file is not None  # (validated)
            try:
                hba = load_hba(auth.auth_hba_file)
            except OSError as exc:
                raise ConfigError(
                    f"auth.auth_hba_file: cannot read {auth.auth_hba_file}: {exc.strerror}"
                ) from exc
            except HbaError as exc:
                raise ConfigError(f"auth.auth_hba_file: {exc}") from exc
        user_maps = _user_maps(auth.auth_ident_file, hba) if hba is not None else None
        return cls(auth.type, users, hba, user_maps, auth.auth_user, auth.scram_iterations)

    def proves(self, name: str | None, user: str, user_map: str | None) -> bool:
        """Whether the name a connection proves (its OS user, its certificate's
        CN) lets it log in as ``user``: the same name, or a line of the HBA
        rule's user name map."""
        if name is None:
            return False
        if user_map is None:
            return name == user
        return self.user_maps is not None and self.user_maps.allows(user_map, name, user)

    def secret_for(self, user: str) -> str | None:
        return self.users.get(user)

    def looks_up(self, target: DatabaseTarget, user: str, method: str) -> bool:
        """Whether a login by ``user`` with ``method`` needs auth_query for its
        secret: an auth_user (the database's or the global one), a password
        method, and no secret here (PgBouncer's order)."""
        return (
            (target.auth_user or self.auth_user) is not None
            and method in PASSWORD_METHODS
            and user not in self.users
        )

    def server_credentials(
        self, target: DatabaseTarget, client_user: str, looked_up: str | None = None
    ) -> tuple[str, str | None]:
        """The user and password a pool logs in to PostgreSQL with.

        A ``database_url`` with a user forces that user for everyone (PgBouncer's
        forced user); otherwise the client's own name and stored secret are used
        (``looked_up``: the one auth_query found).
        """
        if target.user:
            return target.user, target.password
        return client_user, self.users.get(client_user, looked_up)


def _user_maps(path: str | None, hba: HbaRules) -> UserMaps | None:
    """auth.auth_ident_file, read; every map= of the HBA rules must be in it
    (PostgreSQL finds a missing map only at a login, and refuses it then)."""
    maps = None
    if path:
        try:
            maps = load_user_maps(path)
        except OSError as exc:
            raise ConfigError(f"auth.auth_ident_file: cannot read {path}: {exc.strerror}") from exc
        except HbaError as exc:
            raise ConfigError(f"auth.auth_ident_file: {exc}") from exc
    for rule in hba.rules:
        if rule.user_map is not None and (maps is None or rule.user_map not in maps.maps):
            where = f"the user name maps of {path}" if path else "auth.auth_ident_file (not set)"
            raise ConfigError(
                f"auth.auth_hba_file: line {rule.line} names map={rule.user_map}, "
                f"which is not in {where}"
            )
    return maps
