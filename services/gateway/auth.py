"""API keys → tenants. The only authentication the mesh does, in one place."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from services.runtime.errors import InvalidArgument, Unauthenticated


class ApiKeys:
    def __init__(self, keys: dict[str, str]):
        self._keys = dict(keys)

    @classmethod
    def from_config(cls, pairs: str, path: str) -> ApiKeys:
        keys: dict[str, str] = {}
        if path:
            loaded = json.loads(Path(path).read_text())
            if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
                raise InvalidArgument(f"{path} must be a JSON object of api key -> tenant")
            keys.update(loaded)
        for pair in filter(None, (p.strip() for p in pairs.split(","))):
            key, sep, tenant = pair.partition("=")
            if not sep or not key or not tenant:
                raise InvalidArgument(f"api key entry {pair[:6]}... must look like key=tenant")
            keys[key] = tenant
        return cls(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_for(self, authorization: str) -> str:
        """The tenant of an ``authorization`` value ``Bearer <key>`` (gRPC metadata or HTTP
        header alike), or :class:`Unauthenticated`."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("missing API key: send `authorization: Bearer <key>`")
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise Unauthenticated("invalid API key")
