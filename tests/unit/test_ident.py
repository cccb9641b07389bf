"""scry.ident: pg_ident.conf-format user name maps, parsed and matched without sockets."""

from __future__ import annotations

import pytest

from scry.hba import HbaError
from scry.ident import UserMaps, parse_user_maps

MAPS = r"""
# MAP      SYSTEM-USERNAME          DATABASE-USERNAME
staff      alice                    app
staff      alice                    reports     # one system user, two database users
staff      bob                      all
certs      /^(\w+)\.ops\.example$   \1
certs      "/^svc-(a|b),x$"         batch       # quoted: the comma is the expression's
certs      /^admin$                 "all"       # quoted: a user named all
"""


@pytest.fixture
def maps() -> UserMaps:
    return parse_user_maps(MAPS, "ident.conf")


def test_a_literal_line_maps_one_system_user_to_one_database_user(maps: UserMaps) -> None:
    assert maps.allows("staff", "alice", "app")
    assert maps.allows("staff", "alice", "reports")
    assert not maps.allows("staff", "alice", "postgres")
    assert not maps.allows("staff", "carol", "app")
    assert not maps.allows("other", "alice", "app")  # (no such map)
    assert not maps.allows("certs", "alice", "app")  # (another map's lines)


def test_all_lets_the_system_user_in_as_anyone(maps: UserMaps) -> None:
    assert maps.allows("staff", "bob", "postgres")
    assert maps.allows("staff", "bob", "app")


def test_a_regular_expression_and_its_group(maps: UserMaps) -> None:
    assert maps.allows("certs", "jane.ops.example", "jane")
    assert not maps.allows("certs", "jane.ops.example", "john")
    assert not maps.allows("certs", "jane.ops.example.evil", "jane")  # anchored
    assert maps.allows("certs", "svc-a,x", "batch")
    assert not maps.allows("certs", "svc-c,x", "batch")


def test_a_quoted_all_is_a_name(maps: UserMaps) -> None:
    assert maps.allows("certs", "admin", "all")
    assert not maps.allows("certs", "admin", "app")


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("staff alice", "expected MAP SYSTEM-USERNAME DATABASE-USERNAME"),
        ("staff alice app extra", "expected MAP SYSTEM-USERNAME DATABASE-USERNAME"),
        ("staff alice app,reports", "one name per field"),
        ("include other.conf", "include is not supported"),
        ("include_dir conf.d", "include_dir is not supported"),
        ("staff alice +admins", "group names (+admins)"),
        ("staff alice /^app$", "regular expression as the database user name"),
        ("staff /^(unclosed$ app", "invalid regular expression"),
        (r"staff /^alice$ \1", "the expression has no group"),
    ],
)
def test_lines_scry_cannot_honour_are_refused_with_their_number(line: str, complaint: str) -> None:
    with pytest.raises(HbaError) as caught:
        parse_user_maps("# maps\n" + line + "\n", "ident.conf")
    assert "ident.conf line 2" in str(caught.value)
    assert complaint in str(caught.value)
