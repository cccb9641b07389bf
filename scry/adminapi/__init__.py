"""The admin API served by the proxy (aiohttp); payloads live in ``admin.schemas``."""

from scry.adminapi.server import AdminServer, ApiError

__all__ = ["AdminServer", "ApiError"]
