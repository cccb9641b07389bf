"""The settings a StartupMessage asks for (scry.client_login.startup_settings),
and how PgBouncer's ignore_startup_parameters = options reads them
(lenient_options)."""

from __future__ import annotations

import pytest

from scry.client_login import lenient_options, startup_settings
from scry.protocol.errors import ProtocolViolation


def test_options_give_settings_under_postgres_names() -> None:
    params = {"user": "app", "options": r"-c search_path=a,b --lock-timeout=5s -c x.y=a\ b"}
    assert startup_settings(params) == {
        "search_path": "a,b",
        "lock_timeout": "5s",
        "x.y": "a b",
    }


def test_a_setting_named_on_its_own_wins_over_options() -> None:
    # (PostgreSQL applies options first, then the named parameters, in either order.)
    for params in (
        {"options": "-c TimeZone=UTC -c DateStyle=ISO", "timezone": "Asia/Tokyo"},
        {"timezone": "Asia/Tokyo", "options": "-c TimeZone=UTC -c DateStyle=ISO"},
    ):
        assert startup_settings(params) == {"TimeZone": "Asia/Tokyo", "DateStyle": "ISO"}


@pytest.mark.parametrize("options", ["endpoint=ep-1", "-c", "-c =1"])
def test_malformed_options_are_refused(options: str) -> None:
    with pytest.raises(ProtocolViolation):
        startup_settings({"user": "app", "options": options})


def test_ignored_options_drop_a_malformed_string_whole() -> None:
    params = {"user": "app", "options": "endpoint=ep-1 -c TimeZone=UTC", "DateStyle": "ISO"}
    kept, droppable = lenient_options(params, frozenset({"options", "extra_float_digits"}))
    assert kept == {"user": "app", "DateStyle": "ISO"}
    assert droppable == {"options", "extra_float_digits"}


def test_ignored_options_make_only_their_own_settings_droppable() -> None:
    params = {"options": "-c TimeZone=UTC -c statement_timeout=soon", "timezone": "Asia/Tokyo"}
    kept, droppable = lenient_options(params, frozenset({"options"}))
    assert kept is params
    # (TimeZone is named on its own too: that value wins, and is refused, not dropped.)
    assert droppable == {"options", "statement_timeout"}
