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
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.runtime.errors import InvalidArgument, Unauthenticated
from services.runtime.reloaded_files import ReloadedFiles
from services.runtime.tenants_file import QuotaConfig, TenantsFile

log = logging.getLogger("loramesh.gateway")

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


TENANTS_CHECK_INTERVAL_S = 1.0
"""How often, at most, the gateway looks at its tenants file for a change (at a request)."""

Loaded = tuple[list[_HashedKey], QuotaConfig]


def _parse_tenants(path: str) -> Callable[[tuple[bytes, ...], int], Loaded]:
    """The tenants file's keys, parsed (hashed) and its limits; ValueError naming what is wrong."""

    def parse(contents: tuple[bytes, ...], _generation: int) -> Loaded:
        try:
            tenants = TenantsFile.parse(json.loads(contents[0]), path)
            return [_HashedKey.parse(entry, tenant) for entry, tenant in tenants.keys.items()], tenants.quotas
        except InvalidArgument as error:
            raise ValueError(error.message) from None

    return parse


class ApiKeys:
    """The API keys and the tenants' limits in force. Those of a tenants file are read again when
    it changes (:class:`~services.runtime.reloaded_files.ReloadedFiles`, as the TLS certificates
    are): a request looks at the file at most every :data:`TENANTS_CHECK_INTERVAL_S`, and an edit
    takes effect from then on, without a restart; a file that does not parse leaves the previous
    keys and limits in force (and is logged once)."""

    def __init__(self, keys: dict[str, str], quotas: QuotaConfig | None = None):
        """``keys``: API key, or its :func:`hash_api_key`, -> tenant; ``quotas``: the tenants'
        limits (none by default), which the gateway's core enforces."""
        self._given = [_HashedKey.parse(entry, tenant) for entry, tenant in keys.items()]
        self._keys = self._given
        self.quotas = quotas or QuotaConfig()
        self._file: ReloadedFiles[Loaded] | None = None
        self._generation = 0
        self.on_reload: list[Callable[[QuotaConfig], None]] = []
        """Told the new limits after each reload of the tenants file."""

    @staticmethod
    def read_file(path: str) -> dict[str, str]:
        """A tenants file's ``{API key or its hash: tenant}`` (its limits aside)."""
        return TenantsFile.read(path).keys

    @classmethod
    def from_config(cls, pairs: str, path: str, clock: Callable[[], float] = time.monotonic) -> ApiKeys:
        """The keys of ``--api-keys`` (``key=tenant,...``) and of the tenants file ``path``
        (read again when it changes; ``clock``: monotonic seconds), with the file's limits."""
        keys: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in pairs.split(","))):
            key, sep, tenant = pair.rpartition("=")
            if not sep or not key or not tenant:
                raise InvalidArgument("every api key entry must look like key=tenant")
            keys[key] = tenant
        api_keys = cls(keys)
        if path:
            try:
                api_keys._file = ReloadedFiles((path,), _parse_tenants(path), "the tenants file", clock)
            except ValueError as error:
                raise InvalidArgument(f"{path}: {error}") from None
            api_keys._take()
        return api_keys

    def reload(self, max_age_s: float = 0.0) -> bool:
        """Take the tenants file's keys and limits if it changed (looked at unless it was in the
        last ``max_age_s``; 0: now). Whether they changed."""
        if self._file is None:
            return False
        self._file.poll(max_age_s)
        if self._file.generation == self._generation:
            return False
        self._take()
        log.info(
            "tenants file %s reloaded: %d API keys, %d tenant limit entries",
            self._file.paths[0], len(self._keys), len(self.quotas.limits),
        )  # fmt: skip
        for listener in self.on_reload:
            listener(self.quotas)
        return True

    def _take(self) -> None:
        """The file's current keys and limits; ``--api-keys`` ones first (the first match wins, so
        a key in both is the tenant ``--api-keys`` names, as it always was)."""
        assert self._file is not None
        file_keys, self.quotas = self._file.current
        self._keys = [*self._given, *file_keys]
        self._generation = self._file.generation

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_for(self, authorization: str) -> str:
        """The tenant of an ``authorization`` value ``Bearer <key>`` (gRPC metadata or HTTP
        header alike), or :class:`Unauthenticated`."""
        self.reload(TENANTS_CHECK_INTERVAL_S)
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
