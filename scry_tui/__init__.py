"""The operator console (Textual). Talks to proxies only through the admin package."""
