"""Sans-I/O PostgreSQL v3 wire protocol: framing, messages, startup and errors."""
