"""The lending lane's tokens: which debtor a connection acts for, and until when, signed by the
creditor that issued it.

A token is issued by the creditor's ``OpenLendingLane`` RPC (mutual TLS and the authorization
table guard it) to the caller's own instance, and presented once, as the first frame of a lane
connection. It carries its debtor and its expiry and an HMAC-SHA256 of both under a key that
never leaves the creditor's process (random at each start), so the creditor keeps no table of
tokens and checks one without reading more than its few hundred bytes. A token opens
connections until it expires (``ttl_s``, counted on the creditor's own monotonic clock: only the
issuer checks it); a debtor asks for a fresh one each time it opens a lane. A connection, once
open, stays open: the token admits, it is not a session.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable

from services.runtime.errors import InvalidArgument

TOKEN_TTL_S = 30.0
"""How long a token opens connections. A debtor connects as soon as ``OpenLendingLane`` answers
(milliseconds), so this only has to outlast a loaded machine's scheduling delays; it is what a
token that leaks (a log, a core dump) is worth."""
HELLO_MAX_BYTES = 512
"""The largest hello (a token) a lane reads before it knows who is calling: a token is 76 bytes
plus 4/3 of its debtor's name, so names up to ~320 bytes fit."""

_VERSION = 1
_FIELDS = struct.Struct("<Bq16s")
"""Version, expiry (the creditor's monotonic clock, nanoseconds), a nonce (two tokens for one
debtor differ), then the debtor's name (UTF-8) and the MAC."""
_MAC_BYTES = hashlib.sha256().digest_size


class TokenRefused(Exception):
    """A hello that does not open a connection; its message says why, in one line."""


class LaneTokens:
    """Issues and checks one creditor's lane tokens."""

    def __init__(self, ttl_s: float = TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic):
        """``clock``: seconds, monotonic (injected in tests)."""
        if ttl_s <= 0:
            raise ValueError(f"lane token TTL must be > 0 s, got {ttl_s:g}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._key = secrets.token_bytes(32)

    def issue(self, debtor: str) -> str:
        """A token for ``debtor`` (the caller's verified instance), valid ``ttl_s`` from now."""
        expiry_ns = int((self._clock() + self.ttl_s) * 1e9)
        body = _FIELDS.pack(_VERSION, expiry_ns, secrets.token_bytes(16)) + debtor.encode()
        token = base64.urlsafe_b64encode(body + self._mac(body)).decode()
        if len(token) > HELLO_MAX_BYTES:
            raise InvalidArgument(
                f"debtor name of {len(debtor.encode())} bytes is too long for a lane token "
                f"(the hello is at most {HELLO_MAX_BYTES} bytes)"
            )
        return token

    def debtor(self, hello: bytes) -> str:
        """Whom the token ``hello`` was issued to; TokenRefused when it is not one of ours or
        has expired."""
        try:
            raw = base64.urlsafe_b64decode(hello)
        except (binascii.Error, ValueError):
            raise TokenRefused(f"lane token of {len(hello)} bytes is not base64") from None
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if len(body) < _FIELDS.size:
            raise TokenRefused(f"lane token of {len(raw)} bytes is too short to be one")
        if not hmac.compare_digest(mac, self._mac(body)):
            raise TokenRefused("lane token's signature does not match: not issued by this creditor")
        version, expiry_ns, _ = _FIELDS.unpack_from(body)
        debtor = body[_FIELDS.size :].decode(errors="replace")
        if version != _VERSION:
            raise TokenRefused(f"lane token of version {version}, not {_VERSION}")
        late_s = self._clock() - expiry_ns / 1e9
        if late_s > 0:
            raise TokenRefused(f"lane token of debtor {debtor!r} expired {late_s:.1f} s ago")
        return debtor

    def _mac(self, body: bytes) -> bytes:
        return hmac.digest(self._key, body, hashlib.sha256)
