"""The prepared-statement rewriter's answer to PQprepare without a server (sans I/O).

A batch of named Parses and a Sync, of statements the pool has parsed before,
is answered by scry; each Parse goes to the server in front of the statement's
first Bind or Describe, planned afresh, and its ParseComplete is not forwarded.
"""

from __future__ import annotations

from scry.protocol import messages as m
from scry.protocol.framing import MessageReader
from scry.protocol.prepared import (
    CLOSE_COMPLETE,
    PARSE_COMPLETE,
    ClientStatements,
    ParsedStatements,
    ServerStatements,
    answer_prepare,
    rewrite,
    server_name,
)

P, B, D, C, E, S = (ord(k) for k in "PBDCES")
REST = b"select $1::int + 1\x00\x00\x00"  # query NUL, no parameter types
SNAME = server_name(REST)
BIND = b"\x00s1\x00\x00\x00\x00\x01\x00\x00\x00\x0141\x00\x00"  # portal "", s1, $1 = '41'


def parse(name: bytes, rest: bytes = REST) -> tuple[int, bytes]:
    return (P, name + b"\x00" + rest)


def decoded(data: bytes) -> list[tuple[int, bytes]]:
    reader = MessageReader()
    reader.feed(data)
    messages = reader.messages()
    assert reader.buffered == 0
    return messages


def known() -> ParsedStatements:
    parsed = ParsedStatements(8)
    parsed.add(SNAME)
    return parsed


def test_a_known_statement_is_answered_as_the_server_would() -> None:
    client = ClientStatements()
    answer = answer_prepare([parse(b"s1"), parse(b"s2"), (S, b"")], client, known())
    assert answer is not None
    assert decoded(answer) == [(PARSE_COMPLETE, b""), (PARSE_COMPLETE, b""), (ord("Z"), b"I")]
    assert client.by_name == {b"s1": (SNAME, REST), b"s2": (SNAME, REST)}
    assert client.deferred == {b"s1", b"s2"}


def test_anything_else_needs_a_server() -> None:
    parsed = known()
    other = b"select 2\x00\x00\x00"
    for batch in (
        [parse(b"s1", other), (S, b"")],  # never parsed in this pool
        [parse(b"s1"), parse(b"s2", other), (S, b"")],  # one of them unknown
        [parse(b""), (S, b"")],  # the unnamed statement
        [parse(b"s1")],  # no Sync yet
        [parse(b"s1"), (ord("H"), b"")],  # Flush: the client waits for ParseComplete
        [parse(b"s1"), (B, BIND), (ord("E"), b"\x00\x00\x00\x00\x00"), (S, b"")],
        [(P, b"s1-without-a-nul"), (S, b"")],
        [(S, b"")],
    ):
        client = ClientStatements()
        assert answer_prepare(batch, client, parsed) is None, batch
        assert client.by_name == {} and client.deferred == set()


def test_the_first_bind_parses_afresh_and_hides_the_parse_complete() -> None:
    parsed = known()
    client, server = ClientStatements(), ServerStatements(4, parsed)
    server.names[SNAME] = None  # another client's statement: not reused for this Parse
    answer_prepare([parse(b"s1"), (S, b"")], client, parsed)

    sent = decoded(rewrite([(B, BIND), (E, b"\x00\x00\x00\x00\x00"), (S, b"")], client, server))
    assert [kind for kind, _ in sent] == [C, P, B, E, S]
    assert sent[0][1] == b"S" + SNAME + b"\x00"
    assert sent[1][1] == SNAME + b"\x00" + REST
    assert sent[2][1] == b"\x00" + SNAME + b"\x00\x00\x00\x00\x01\x00\x00\x00\x0141\x00\x00"
    assert [(x.kind, x.drop) for x in server.expect] == [
        (CLOSE_COMPLETE, True),
        (PARSE_COMPLETE, True),
    ]
    assert client.deferred == set()

    # The server answers: both hidden; the statement is now the server's.
    assert server.on_response(CLOSE_COMPLETE) is True
    assert server.on_response(PARSE_COMPLETE) is True
    sent = decoded(rewrite([(B, BIND), (E, b"\x00\x00\x00\x00\x00"), (S, b"")], client, server))
    assert [kind for kind, _ in sent] == [B, E, S]


def test_a_describe_parses_a_deferred_statement_first() -> None:
    parsed = known()
    client, server = ClientStatements(), ServerStatements(4, parsed)
    answer_prepare([parse(b"s1"), (S, b"")], client, parsed)
    sent = decoded(rewrite([(D, b"Ss1\x00"), (S, b"")], client, server))
    assert sent == [(P, SNAME + b"\x00" + REST), (D, b"S" + SNAME + b"\x00"), (S, b"")]
    assert [(x.kind, x.drop) for x in server.expect] == [(PARSE_COMPLETE, True)]


def test_close_or_a_new_parse_ends_the_deferral() -> None:
    parsed = known()
    client, server = ClientStatements(), ServerStatements(4, parsed)
    answer_prepare([parse(b"s1"), parse(b"s2"), (S, b"")], client, parsed)
    sent = decoded(rewrite([(C, b"Ss1\x00"), parse(b"s2"), (S, b"")], client, server))
    assert [kind for kind, _ in sent] == [C, P, S]
    assert client.deferred == set()
    assert b"s1" not in client.by_name
    # The client's own Parse of s2 is answered to the client, not hidden.
    assert [(x.kind, x.drop) for x in server.expect] == [
        (CLOSE_COMPLETE, False),
        (PARSE_COMPLETE, False),
    ]


def test_a_failed_deferred_parse_is_reported_at_each_use() -> None:
    """The Parse fails at the Bind (a table dropped meanwhile): the next Bind parses again."""
    parsed = known()
    client, server = ClientStatements(), ServerStatements(4, parsed)
    answer_prepare([parse(b"s1"), (S, b"")], client, parsed)
    rewrite([(B, BIND), (E, b"\x00\x00\x00\x00\x00"), (S, b"")], client, server)
    server.segments_sent += 1
    server.on_error()  # PostgreSQL skips the rest of the segment
    server.segments_done += 1
    server.on_ready()
    assert SNAME not in server.names
    sent = decoded(rewrite([(B, BIND), (E, b"\x00\x00\x00\x00\x00"), (S, b"")], client, server))
    # (the name may or may not exist after the skipped Parse: closed first, harmlessly)
    assert [kind for kind, _ in sent] == [C, P, B, E, S]


def test_parse_completes_teach_the_pool_which_statements_parse() -> None:
    parsed = ParsedStatements(2)
    client, server = ClientStatements(), ServerStatements(4, parsed)
    rewrite([parse(b"s1"), (S, b"")], client, server)
    assert SNAME not in parsed  # sent, not yet answered
    server.on_response(PARSE_COMPLETE)
    assert SNAME in parsed
    # An LRU as large as the pool's servers can hold together.
    parsed.add(b"a")
    parsed.add(SNAME)
    parsed.add(b"b")
    assert list(parsed.names) == [SNAME, b"b"]


def test_the_answer_says_idle() -> None:
    answer = answer_prepare([parse(b"s1"), (S, b"")], ClientStatements(), known())
    assert answer is not None and answer.endswith(m.ready_for_query())
