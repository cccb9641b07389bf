"""scry: a PostgreSQL connection pooler and proxy with per-query observability."""

__version__ = "0.1.0"
