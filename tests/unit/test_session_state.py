"""Unit tests for scry.protocol.session_state: the per-client pin tracker.

Driven by real statement texts through classify(), so the two halves are
tested together the way the proxy uses them.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scry.protocol.classify import classify
from scry.protocol.session_state import SessionState


def run(state: SessionState, sql: str, in_transaction: bool = False) -> None:
    state.apply(classify(sql), in_transaction, statement=sql)


def test_new_session_is_unpinned() -> None:
    state = SessionState()
    assert not state.pinned
    assert state.reasons() == ()
    assert not state.replayable
    assert state.replay_statements() == []
    assert state.pin_statement("set") is None


def test_stateless_statements_change_nothing() -> None:
    state = SessionState()
    for sql in ("SELECT 1", "BEGIN", "UPDATE t SET a = 1", "COMMIT", "SET LOCAL a = 1"):
        run(state, sql)
    assert not state.pinned


def test_set_pins_and_reset_unpins() -> None:
    state = SessionState()
    run(state, "SET search_path = app")
    assert state.pinned and state.reasons() == ("set",)
    assert state.replayable
    assert state.replay_statements() == ["SET search_path = app"]
    run(state, "RESET search_path")
    assert not state.pinned


def test_later_set_replaces_and_moves_last() -> None:
    state = SessionState()
    run(state, "SET a = 1")
    run(state, "SET b = 2")
    run(state, "SET a = 3")
    assert state.replay_statements() == ["SET b = 2", "SET a = 3"]
    run(state, "SET a TO DEFAULT")
    assert state.replay_statements() == ["SET b = 2"]


def test_reset_all_keeps_role_and_session_authorization() -> None:
    state = SessionState()
    run(state, "SET ROLE admin")
    run(state, "SET work_mem = '64MB'")
    run(state, "RESET ALL")
    assert state.replay_statements() == ["SET ROLE admin"]
    run(state, "RESET ROLE")
    assert not state.pinned


def test_replay_order_sets_then_prepares() -> None:
    state = SessionState()
    run(state, "PREPARE p1 AS SELECT 1")
    run(state, "SET a = 1")
    run(state, "PREPARE p2 AS SELECT 2")
    run(state, "SELECT set_config('app.user', '7', false)")
    assert state.reasons() == ("prepare", "set")
    assert state.replayable
    assert state.replay_statements() == [
        "SET a = 1",
        "SELECT pg_catalog.set_config('app.user', '7', false)",
        "PREPARE p1 AS SELECT 1",
        "PREPARE p2 AS SELECT 2",
    ]
    run(state, "DEALLOCATE p1")
    assert state.replay_statements()[-1] == "PREPARE p2 AS SELECT 2"
    run(state, "DEALLOCATE ALL")
    assert state.reasons() == ("set",)


def test_non_replayable_set_makes_session_unreplayable() -> None:
    state = SessionState()
    run(state, "SET a = 1")
    run(state, "SELECT set_config($1, $2, false)")
    assert state.pinned and not state.replayable
    assert state.replay_statements() == ["SET a = 1"]


def test_temp_tables_cursors_listen_are_not_replayable() -> None:
    state = SessionState()
    run(state, "SET a = 1")
    run(state, "CREATE TEMP TABLE t (x int)")
    run(state, "DECLARE c CURSOR WITH HOLD FOR SELECT 1")
    run(state, "LISTEN jobs")
    assert state.reasons() == ("cursor", "listen", "set", "temp_table")
    assert not state.replayable
    run(state, "DROP TABLE t, other_table")
    run(state, "CLOSE c")
    run(state, "UNLISTEN *")
    assert state.reasons() == ("set",) and state.replayable


def test_drop_of_unknown_names_is_ignored() -> None:
    state = SessionState()
    run(state, "CREATE TEMP TABLE t (x int)")
    run(state, "DROP TABLE u")
    assert state.reasons() == ("temp_table",)
    run(state, "DISCARD TEMP")
    assert not state.pinned


def test_advisory_lock_counts() -> None:
    state = SessionState()
    run(state, "SELECT pg_advisory_lock(1)")
    run(state, "SELECT pg_advisory_lock(2), pg_try_advisory_lock(3)")
    assert state.describe()["counts"]["advisory_lock"] == 3
    run(state, "SELECT pg_advisory_unlock(1)")
    run(state, "SELECT pg_advisory_unlock(2)")
    assert state.pinned
    run(state, "SELECT pg_advisory_unlock(3)")
    assert not state.pinned
    run(state, "SELECT pg_advisory_unlock(3)")  # never negative
    assert state.describe()["counts"]["advisory_lock"] == 0
    run(state, "SELECT pg_advisory_lock(1)")
    run(state, "SELECT pg_advisory_lock(1)")
    run(state, "SELECT pg_advisory_unlock_all()")
    assert not state.pinned


def test_discard_all_clears_everything() -> None:
    state = SessionState()
    for sql in (
        "SET ROLE admin",
        "PREPARE p AS SELECT 1",
        "CREATE TEMP TABLE t (x int)",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
        "SELECT pg_advisory_lock(1)",
        "LISTEN ch",
        "LOAD 'auto_explain'",
    ):
        run(state, sql)
    assert state.reasons() == (
        "advisory_lock", "cursor", "listen", "load", "prepare", "set", "temp_table",
    )  # fmt: skip
    run(state, "DISCARD ALL")
    assert not state.pinned and state.reasons() == ()
    assert state.pin_statement("set") is None


def test_load_pins_for_good() -> None:
    state = SessionState()
    run(state, "LOAD 'auto_explain'")
    assert state.reasons() == ("load",) and not state.replayable
    assert state.describe()["other"] == {"load": ["auto_explain"]}


# --- transactions --------------------------------------------------------------


def test_commit_keeps_tentative_effects() -> None:
    state = SessionState()
    run(state, "SET a = 1", in_transaction=True)
    assert state.pinned  # visible while the transaction is open
    state.commit()
    assert state.replay_statements() == ["SET a = 1"]
    state.rollback()  # no transaction open: nothing to undo
    assert state.pinned


def test_rollback_drops_transactional_and_keeps_the_rest() -> None:
    state = SessionState()
    run(state, "SET keep = 1")
    run(state, "SET a = 1", in_transaction=True)
    run(state, "CREATE TEMP TABLE t (x int)", in_transaction=True)
    run(state, "PREPARE p AS SELECT 1", in_transaction=True)
    run(state, "SELECT pg_advisory_lock(1)", in_transaction=True)
    run(state, "LISTEN ch", in_transaction=True)
    run(state, "LOAD 'auto_explain'", in_transaction=True)
    state.rollback()
    assert state.reasons() == ("advisory_lock", "load", "prepare", "set")
    assert state.replay_statements() == ["SET keep = 1", "PREPARE p AS SELECT 1"]
    assert state.describe()["counts"]["advisory_lock"] == 1


def test_rollback_restores_what_the_transaction_removed() -> None:
    state = SessionState()
    run(state, "SET a = 1")
    run(state, "CREATE TEMP TABLE t (x int)")
    run(state, "RESET a", in_transaction=True)
    run(state, "DROP TABLE t", in_transaction=True)
    assert not state.pinned
    state.rollback()
    assert state.reasons() == ("set", "temp_table")
    assert state.replay_statements() == ["SET a = 1"]


def test_rollback_does_not_restore_what_non_transactional_statements_removed() -> None:
    state = SessionState()
    run(state, "PREPARE p AS SELECT 1")
    run(state, "SELECT pg_advisory_lock(1)")
    run(state, "DECLARE c CURSOR WITH HOLD FOR SELECT 1")
    run(state, "DEALLOCATE p", in_transaction=True)
    run(state, "SELECT pg_advisory_unlock(1)", in_transaction=True)
    run(state, "CLOSE c", in_transaction=True)
    state.rollback()
    assert not state.pinned


def test_rollback_after_commit_is_a_no_op() -> None:
    state = SessionState()
    run(state, "SET a = 1", in_transaction=True)
    state.commit()
    run(state, "SET b = 2", in_transaction=True)
    state.rollback()
    assert state.replay_statements() == ["SET a = 1"]


def test_apply_failed_keeps_only_non_transactional_pins() -> None:
    state = SessionState()
    sql = "SELECT pg_advisory_lock(1); SET a = 1; PREPARE p AS SELECT 1; SELECT 1/0"
    state.apply_failed(classify(sql), statement=sql)
    assert state.reasons() == ("advisory_lock", "prepare")


def test_pin_statement_and_describe() -> None:
    state = SessionState()
    run(state, "SET a = 1")
    run(state, "SET b = 2")
    run(state, "CREATE TEMP TABLE t (x int)")
    assert state.pin_statement("set") == "SET a = 1"
    assert state.pin_statement("temp_table") == "CREATE TEMP TABLE t (x int)"
    state.apply(classify("SELECT pg_advisory_lock(42)"), False)  # no statement given
    assert state.pin_statement("advisory_lock") == "advisory_lock"
    info = state.describe()
    assert info["pinned"] is True
    assert info["reasons"] == ["advisory_lock", "set", "temp_table"]
    assert info["replayable"] is False
    assert info["counts"]["set"] == 2 and info["counts"]["temp_table"] == 1
    assert info["statements"] == ["SET a = 1", "SET b = 2"]
    assert info["temp_tables"] == ["t"]
    assert info["pinned_by"]["temp_table"] == "CREATE TEMP TABLE t (x int)"
    run(state, "DROP TABLE t")
    assert state.pin_statement("temp_table") is None


def test_clear_forgets_everything() -> None:
    state = SessionState()
    run(state, "SET a = 1", in_transaction=True)
    state.clear()
    assert not state.pinned
    state.rollback()
    assert not state.pinned


# --- a property: rollback is exactly "as if the transaction never ran" for
# transactional statements, and "as if it committed" for the rest.

TRANSACTIONAL = ["SET a = 1", "SET b = 2", "RESET a", "RESET ALL", "CREATE TEMP TABLE t (x int)",
                 "DROP TABLE t", "LISTEN ch", "UNLISTEN *", "DECLARE c CURSOR WITH HOLD FOR SELECT 1"]  # fmt: skip
NON_TRANSACTIONAL = ["PREPARE p AS SELECT 1", "DEALLOCATE p", "SELECT pg_advisory_lock(1)",
                     "SELECT pg_advisory_unlock(1)", "CLOSE c"]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.sampled_from(TRANSACTIONAL + NON_TRANSACTIONAL), max_size=5),
    inside=st.lists(st.sampled_from(TRANSACTIONAL), max_size=6),
)
def test_rolled_back_transactional_statements_leave_no_trace(
    before: list[str], inside: list[str]
) -> None:
    state, reference = SessionState(), SessionState()
    for sql in before:
        run(state, sql)
        run(reference, sql)
    for sql in inside:
        run(state, sql, in_transaction=True)
    state.rollback()
    assert state.describe() == reference.describe()
