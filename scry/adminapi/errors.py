"""The admin API's error answer, raised anywhere below a handler."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """An error answer: HTTP status, stable code, message (docs/admin-api.md, Errors)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
