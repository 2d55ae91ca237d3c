"""The tenants file: API keys, and each tenant's limits, read by the gateways and the adapter store.

One JSON file, the plain ``{api key: tenant}`` object or::

    {"keys": {api key (or its hash): tenant},
     "tenants": {tenant: limits, "*": the limits of every tenant not named},
     "quota_window_s": 60}

Each service enforces the limits that concern it and ignores the others: the gateway the
generations' (:mod:`services.gateway.tenant_quota`), the adapter store what a tenant stores and
uploads (:mod:`services.adapter_store.tenant_storage_quota`). Both parse the whole file here, so a
file one of them accepts, the other accepts too (docs/operations.md, "Tenants and quotas").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.runtime.errors import InvalidArgument

DEFAULT_WINDOW_S = 60.0
"""The quota window when the tenants file names none."""
ALL_TENANTS = "*"
"""The entry of the tenants file's ``"tenants"`` that applies to every tenant not named."""


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; 0 is unlimited."""

    max_concurrent_requests: int = 0
    """Generations in flight at once, every gateway's together when they share etcd (the gateway)."""
    tokens_per_minute: int = 0
    """Prompt plus generated tokens per minute, a token bucket over the quota window, each gateway
    sharing etcd refilling its share (the gateway)."""
    max_waiting_requests: int | None = None
    """Generations that wait for one of the ``max_concurrent_requests`` slots, first come first
    served; None: as many as ``max_concurrent_requests``; 0: none (refused at once) (the gateway)."""
    max_adapters: int = 0
    """Adapters the tenant owns at once, every replica's together (the adapter store)."""
    max_stored_bytes: int = 0
    """Bytes of the tenant's adapters together: weights, config and chat templates of each (the
    adapter store)."""
    max_concurrent_uploads: int = 0
    """Uploads and imports of the tenant in flight at once, every replica's together (the adapter
    store)."""

    @property
    def waiting_room(self) -> int:
        """Places for generations waiting for a slot (0 without a concurrency limit)."""
        if not self.max_concurrent_requests:
            return 0
        return (
            self.max_concurrent_requests if self.max_waiting_requests is None else self.max_waiting_requests
        )

    @property
    def limits_storage(self) -> bool:
        """Whether the tenant's adapters are bounded in number or bytes."""
        return bool(self.max_adapters or self.max_stored_bytes)

    @classmethod
    def parse(cls, tenant: str, value: object) -> TenantLimits:
        """From the tenants file's entry for ``tenant``: an object of the fields above."""
        if not isinstance(value, dict):
            raise InvalidArgument(f"tenants[{tenant!r}] must be an object of limits")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise InvalidArgument(f"tenants[{tenant!r}] has unknown fields {unknown}; known: {sorted(known)}")
        for name, limit in value.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise InvalidArgument(
                    f"tenants[{tenant!r}].{name} must be a whole number >= 0 (0: unlimited)"
                )
        return cls(**value)

    def to_json(self) -> dict[str, int]:
        """The tenants file's entry: the fields that are set (a limit left out is unlimited;
        ``max_waiting_requests`` 0 is kept: nobody waits)."""
        return {
            name: limit
            for name, limit in vars(self).items()
            if limit or (limit == 0 and name == "max_waiting_requests")
        }


UNLIMITED = TenantLimits()


@dataclass(frozen=True)
class QuotaConfig:
    """The limits of every tenant and the window of ``tokens_per_minute``."""

    limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    """Tenant (or :data:`ALL_TENANTS`) -> its limits."""
    window_s: float = DEFAULT_WINDOW_S

    def __post_init__(self):
        if not (
            isinstance(self.window_s, int | float) and math.isfinite(self.window_s) and self.window_s > 0
        ):
            raise InvalidArgument(f"quota_window_s must be a number of seconds > 0, got {self.window_s!r}")

    def for_tenant(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant) or self.limits.get(ALL_TENANTS) or UNLIMITED

    @property
    def limited(self) -> bool:
        """Some tenant has a limit."""
        return any(limits != UNLIMITED for limits in self.limits.values())

    @classmethod
    def parse(cls, tenants: object, window_s: object = DEFAULT_WINDOW_S) -> QuotaConfig:
        """From the tenants file's ``"tenants"`` and ``"quota_window_s"``."""
        if not isinstance(tenants, dict):
            raise InvalidArgument('"tenants" must be an object of tenant -> limits')
        if isinstance(window_s, bool):
            raise InvalidArgument(f"quota_window_s must be a number of seconds > 0, got {window_s!r}")
        return cls({tenant: TenantLimits.parse(tenant, v) for tenant, v in tenants.items()}, window_s)

    def to_json(self) -> dict:
        """The tenants file's ``"tenants"`` and ``"quota_window_s"``."""
        return {
            "tenants": {tenant: limits.to_json() for tenant, limits in self.limits.items()},
            "quota_window_s": self.window_s,
        }


TENANTS_FILE_FIELDS = ("keys", "tenants", "quota_window_s")


@dataclass(frozen=True)
class TenantsFile:
    """What a tenants file holds: the API keys and the tenants' limits."""

    keys: dict[str, str]
    """API key (or its hash) -> tenant."""
    quotas: QuotaConfig = field(default_factory=QuotaConfig)

    @classmethod
    def parse(cls, loaded: object, path: str = "the tenants file") -> TenantsFile:
        """From the file's JSON: ``{key: tenant}``, or ``{"keys": ..., "tenants": ...,
        "quota_window_s": ...}`` (only ``keys`` required)."""
        if isinstance(loaded, dict) and isinstance(loaded.get("keys"), dict):
            unknown = sorted(set(loaded) - set(TENANTS_FILE_FIELDS))
            if unknown:
                raise InvalidArgument(
                    f"{path} has unknown fields {unknown}; known: {list(TENANTS_FILE_FIELDS)}"
                )
            keys = loaded["keys"]
            quotas = QuotaConfig.parse(
                loaded.get("tenants", {}), loaded.get("quota_window_s", DEFAULT_WINDOW_S)
            )
        else:
            keys, quotas = loaded, QuotaConfig()
        if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
            raise InvalidArgument(
                f"{path} must be a JSON object of api key (or its hash) -> tenant, or "
                '{"keys": {api key: tenant}, "tenants": {tenant: limits}}'
            )
        return cls(keys, quotas)

    @classmethod
    def read(cls, path: str) -> TenantsFile:
        return cls.parse(json.loads(Path(path).read_text()), path)

    def to_json(self) -> dict:
        """The file's JSON: the plain form unless some tenant has limits."""
        if not self.quotas.limited and self.quotas.window_s == DEFAULT_WINDOW_S:
            return dict(self.keys)
        return {"keys": dict(self.keys), **self.quotas.to_json()}


def read_tenant_limits(path: str) -> QuotaConfig:
    """The tenants' limits in the tenants file ``path`` ("": none, every tenant unlimited);
    ``ValueError`` naming the file and what is wrong with it."""
    if not path:
        return QuotaConfig()
    try:
        return TenantsFile.read(path).quotas
    except InvalidArgument as error:
        raise ValueError(f"{path}: {error.message}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"tenants file {path}: {error}") from None
