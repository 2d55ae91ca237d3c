"""API keys → tenants. The only authentication the mesh does, in one place.

Keys are held, and may be stored, only as salted hashes (:func:`hash_api_key`,
``sha256:<salt>:<digest>``): a keys file, a Secret or a memory dump gives away no key. A file may
still list plain keys (a local mesh's); they are hashed on load and the plain text dropped.
SHA-256 rather than a slow KDF (scrypt): the gateway hashes the presented key against every entry
on each request, and the keys it is meant for are long random tokens (``loramesh up`` makes 144
bits), which no brute force reaches however fast the hash; the per-entry salt keeps equal keys
from having equal hashes and defeats precomputed tables for the odd short key. No key, and no part
of one, is ever logged or put in an error message.

The keys come from the tenants file (``--api-keys-file``): either the plain ``{key: tenant}``
object, or ``{"keys": {key: tenant}, "tenants": {tenant: limits}, "quota_window_s": 60}`` whose
``tenants`` sets each tenant's limits (:mod:`services.runtime.tenants_file`, which the adapter
store reads too; docs/operations.md, "Tenants and quotas").
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from services.runtime.errors import InvalidArgument, Unauthenticated
from services.runtime.tenants_file import QuotaConfig, TenantsFile

HASH_SCHEME = "sha256"
SALT_BYTES = 16


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode()).digest()


def hash_api_key(key: str, salt: bytes | None = None) -> str:
    """``sha256:<salt hex>:<digest hex>`` of ``key`` (a fresh random salt unless given)."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    return f"{HASH_SCHEME}:{salt.hex()}:{_digest(salt, key).hex()}"


def is_hashed(entry: str) -> bool:
    return entry.startswith(HASH_SCHEME + ":")


def hashed_keys(keys: dict[str, str]) -> dict[str, str]:
    """``keys`` (API key or hash -> tenant) with every plain key replaced by its hash: what a
    keys file should hold."""
    return {entry if is_hashed(entry) else hash_api_key(entry): tenant for entry, tenant in keys.items()}


@dataclass(frozen=True)
class _HashedKey:
    salt: bytes
    digest: bytes
    tenant: str

    @classmethod
    def parse(cls, entry: str, tenant: str) -> _HashedKey:
        """From a hashed entry, or from a plain key (hashed now)."""
        if not is_hashed(entry):
            salt = secrets.token_bytes(SALT_BYTES)
            return cls(salt, _digest(salt, entry), tenant)
        salt_hex, _, digest_hex = entry.removeprefix(HASH_SCHEME + ":").partition(":")
        try:
            salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
        except ValueError:
            raise InvalidArgument(
                f"a hashed API key of tenant {tenant!r} is not sha256:<hex>:<hex>"
            ) from None
        if len(digest) != hashlib.sha256().digest_size or not salt:
            raise InvalidArgument(f"a hashed API key of tenant {tenant!r} has the wrong length")
        return cls(salt, digest, tenant)


class ApiKeys:
    def __init__(self, keys: dict[str, str], quotas: QuotaConfig | None = None):
        """``keys``: API key, or its :func:`hash_api_key`, -> tenant; ``quotas``: the tenants'
        limits (none by default), which the gateway's core enforces."""
        self._keys = [_HashedKey.parse(entry, tenant) for entry, tenant in keys.items()]
        self.quotas = quotas or QuotaConfig()

    @staticmethod
    def read_file(path: str) -> dict[str, str]:
        """A tenants file's ``{API key or its hash: tenant}`` (its limits aside)."""
        return TenantsFile.read(path).keys

    @classmethod
    def from_config(cls, pairs: str, path: str) -> ApiKeys:
        """The keys of ``--api-keys`` (``key=tenant,...``) and of the tenants file ``path``, with
        the file's limits."""
        tenants = TenantsFile.read(path) if path else TenantsFile({})
        keys: dict[str, str] = dict(tenants.keys)
        for pair in filter(None, (p.strip() for p in pairs.split(","))):
            key, sep, tenant = pair.rpartition("=")
            if not sep or not key or not tenant:
                raise InvalidArgument("every api key entry must look like key=tenant")
            keys[key] = tenant
        return cls(keys, tenants.quotas)

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_for(self, authorization: str) -> str:
        """The tenant of an ``authorization`` value ``Bearer <key>`` (gRPC metadata or HTTP
        header alike), or :class:`Unauthenticated`."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("missing API key: send `authorization: Bearer <key>`")
        key = key.strip()
        # Every entry is compared (no early exit), in constant time each.
        found = ""
        for known in self._keys:
            if hmac.compare_digest(known.digest, _digest(known.salt, key)) and not found:
                found = known.tenant
        if not found:
            raise Unauthenticated("invalid API key")
        return found
