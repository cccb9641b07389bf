"""SQLSTATE codes scry answers with, and the protocol-level exception.

Errors that reach a client are PostgreSQL ErrorResponses; the codes below are
PostgreSQL's own (Appendix A of its manual) so drivers and DBAs recognise them.
"""

from __future__ import annotations

# Class 08: connection exception
CONNECTION_EXCEPTION = "08000"
CONNECTION_FAILURE = "08006"
SQLCLIENT_UNABLE_TO_ESTABLISH = "08001"
PROTOCOL_VIOLATION = "08P01"
# Class 0A: feature not supported
FEATURE_NOT_SUPPORTED = "0A000"
# Class 28: invalid authorization
INVALID_AUTHORIZATION = "28000"
INVALID_PASSWORD = "28P01"
# Class 3D: invalid catalog name
INVALID_CATALOG_NAME = "3D000"
# Class 53: insufficient resources
TOO_MANY_CONNECTIONS = "53300"
# Class 57: operator intervention
QUERY_CANCELED = "57014"
ADMIN_SHUTDOWN = "57P01"
CANNOT_CONNECT_NOW = "57P03"
# Class 25: invalid transaction state
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
# Class XX: internal error
INTERNAL_ERROR = "XX000"


class ProtocolViolation(Exception):
    """The peer sent bytes that are not valid PostgreSQL v3 protocol.

    ``sqlstate`` is what the proxy should answer with (08P01 unless a more
    specific code applies).
    """

    def __init__(self, message: str, sqlstate: str = PROTOCOL_VIOLATION) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
