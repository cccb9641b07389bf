"""The proxy's admin HTTP server (see :mod:`scry.adminapi`)."""

from scry.adminapi import AdminServer

__all__ = ["AdminServer"]
