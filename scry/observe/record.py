"""The record the proxy appends for every completed statement.

The hot path must stay cheap, so a record is a plain tuple of numbers and
references, built once per statement and appended to a bounded deque; all
parsing, fingerprinting, hashing and aggregation happens later, off the query
path, in ``scry.observe.pipeline``. Field positions are named below.

    (context, text, t_received, t_acquired, t_sent, t_done, rows, sqlstate, pins)

context
    ``ClientContext``: who ran it (shared by all records of one client).
text
    The statement text as the client sent it (``bytes``, UTF-8, possibly
    truncated to 1 MiB); for the extended protocol, the text of the prepared
    statement behind the portal that was executed.
t_received, t_acquired, t_sent, t_done
    ``time.perf_counter_ns()`` readings: the client's message arrived; a
    server was linked to the client (equal to t_received when one was
    already linked or idle); the message was written to the server (equal to
    t_acquired today); the ReadyForQuery (or CommandComplete for one Execute)
    arrived. queue = acquired - received, backend = done - sent.
rows
    Row count from the CommandComplete tag(s) (0 if none).
sqlstate
    The SQLSTATE of the ErrorResponse, or None.
pins
    None if the client was not pinned, else a tuple of pin reason names
    (``"set"``, ``"prepare"``, ``"temp_table"``, ...).
"""

from __future__ import annotations

from typing import NamedTuple


class ClientContext(NamedTuple):
    """Who a record belongs to; one per client login, replaced when it changes."""

    client_id: str
    database: str
    user: str
    application_name: str
    worker: int = 0
    #: The session reads plain '' literals with backslash escapes
    #: (standard_conforming_strings = off): see scry.protocol.string_escapes.
    nonstandard_strings: bool = False


# Positions in a query record tuple.
CONTEXT, TEXT, T_RECEIVED, T_ACQUIRED, T_SENT, T_DONE, ROWS, SQLSTATE, PINS = range(9)

QueryRecord = tuple[
    ClientContext, bytes, int, int, int, int, int, "str | None", "tuple[str, ...] | None"
]
