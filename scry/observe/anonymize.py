"""Keyed hashing of literal values, so that no value a client sent leaves the process.

Every literal and bind value is replaced by a short, deterministic keyed hash:
the same value always shows the same token within one deployment (so "the
same customer id again" stays visible), but without the key nobody can
confirm a guess. Strings show as ``'k7q2b6…'``, numbers as ``#k7q2b6…``,
dollar-quoted bodies as ``$k7q2b6…$``, bind parameters stay ``$n``.

The key is Blake3 keyed hashing with a 32-byte key derived (Blake3
``derive_key``) from ``observability.anonymize_key``. When no key is
configured, a random one is drawn at start (with several workers, once by
the supervisor and given to all of them: ``scry.workers.worker_config``), so
hashes are comparable across workers but stable only until scry restarts.
"""

from __future__ import annotations

import base64
import secrets

import blake3

from scry.observe.lexer import render

_KEY_CONTEXT = "scry observe anonymize 2024-06 literal hashing key v1"
PREFIX_CHARS = 6


def derive_key(secret: str | None) -> bytes:
    """A 32-byte hashing key from the configured secret, or a random one."""
    if not secret:
        return secrets.token_bytes(32)
    return blake3.blake3(secret.encode("utf-8"), derive_key_context=_KEY_CONTEXT).digest()


def short_token(digest: bytes) -> str:
    """Lower-case base32 prefix of a digest, as shown to people."""
    return base64.b32encode(digest[:5]).decode("ascii").lower()[:PREFIX_CHARS]


class Anonymizer:
    """Keyed hashes of literals; one per Observatory (one key per deployment)."""

    __slots__ = ("_key", "key_is_random")

    def __init__(self, secret: str | None) -> None:
        self._key = derive_key(secret)
        #: True when no key was configured and this process drew its own.
        self.key_is_random = not secret

    def digest(self, data: bytes, length: int = 16) -> bytes:
        """Keyed Blake3 digest of ``data`` (for sketches and tokens)."""
        return blake3.blake3(data, key=self._key).digest(length)

    def hasher(self) -> blake3.blake3:
        """A keyed hasher with no data, for many small values: ``reset()``,
        ``update()``, ``digest()`` (much cheaper than ``digest``: no key setup)."""
        return blake3.blake3(key=self._key)

    def literal_token(self, kind: str, value: str) -> str:
        """The display token for one literal token of the lexer."""
        token = short_token(self.digest(value.encode("utf-8", "surrogatepass")))
        if kind == "number":
            return f"{'-' if value.startswith('-') else ''}#{token}…"
        if kind == "dollar":
            return f"${token}…$"
        if kind == "param":
            return value
        return f"'{token}…'"

    def anonymize_sql(self, text: str) -> str:
        """Query text with comments dropped and every literal replaced by its
        keyed token; identifiers, keywords and structure stay."""
        return render(text, self.literal_token)
