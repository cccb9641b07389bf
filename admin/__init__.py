"""The admin protocol: payload schemas and the HTTP client. Imports nothing from scry."""
