"""Which tenant may import adapters from which sources.

An import runs with the store's own credentials (its AWS environment, its Hub token, its
filesystem), so without this table any tenant could read whatever the store can. Nothing is
allowed unless the operator grants it: the store's ``--import-policy-file`` is JSON mapping each
tenant to the source prefixes it may import from::

    {"tenants": {
        "alice": ["s3://team-bucket/adapters/", "hf://my-org"],
        "admin": ["file:///srv/adapters", "hf://my-org/shared-adapter"]
    }}

A prefix covers a source when it names the same place or a parent of it, segment by segment
(:mod:`services.adapter_store.importers.source_scope`): a bucket or a key prefix, a Hub
organisation or one repository, a directory (resolved, so ``..`` and links cannot leave it).
An ``s3://`` or ``hf://`` source is compared as written, and one with a ``.`` or ``..`` segment,
in any spelling (``%2e%2e``), is refused rather than matched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from services.adapter_store.importers.source_scope import SourceScope, scope_of
from services.runtime.errors import DomainError, PermissionDenied


@dataclass(frozen=True)
class ImportPolicy:
    """Tenant → the source prefixes it may import from."""

    grants: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Source prefixes (``s3://``, ``hf://``, ``file://`` URIs) by tenant, as configured."""

    def __post_init__(self) -> None:
        # Parsed once: a malformed entry fails the store's start, not some tenant's import.
        for tenant, prefixes in self.grants.items():
            for prefix in prefixes:
                try:
                    scope_of(prefix)
                except DomainError as error:
                    raise ValueError(f"import policy for tenant {tenant!r}: {error.message}") from None

    def check(self, tenant: str, uri: str) -> SourceScope:
        """The scope of ``uri``; PermissionDenied naming it unless ``tenant`` was granted it."""
        wanted = scope_of(uri)
        if not any(scope_of(prefix).covers(wanted) for prefix in self.grants.get(tenant, ())):
            raise PermissionDenied(
                f"tenant {tenant!r} may not import from {uri} (the store's --import-policy-file "
                "grants it no source covering it)"
            )
        return wanted


def load_import_policy(path: str) -> ImportPolicy:
    """The policy in the JSON file ``path``; "" → nothing allowed."""
    if not path:
        return ImportPolicy()
    document = json.loads(Path(path).read_text())
    tenants = document.get("tenants") if isinstance(document, dict) else None
    if not isinstance(tenants, dict) or not all(
        isinstance(p, list) and all(isinstance(s, str) for s in p) for p in tenants.values()
    ):
        raise ValueError(f'{path}: expected {{"tenants": {{TENANT: [SOURCE_PREFIX, ...]}}}}')
    return ImportPolicy(MappingProxyType({t: tuple(p) for t, p in tenants.items()}))
