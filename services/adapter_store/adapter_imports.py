"""Importing an adapter from a URI: policy check, fetch, then the upload's registration path.

The tenant's grant is checked before the source is touched, so a refused import reads nothing
with the store's credentials; so is its bound on uploads and imports in flight
(:mod:`services.adapter_store.tenant_storage_quota`). The files are held in memory, bounded by the store's upload limit,
and registered by :meth:`AdapterRegistrar.register_version`: the same validation and sha256 as
an upload, nothing stored on any failure, a new version only when the content changed.
"""

from __future__ import annotations

from services.adapter_store.import_policy import ImportPolicy
from services.adapter_store.importers.by_scheme import open_source
from services.adapter_store.importers.source import CONFIG_FILE, WEIGHTS_FILE, fetch_adapter_files
from services.adapter_store.registrar import AdapterRegistration, AdapterUpload, check_name
from services.adapter_store.repository import AdapterRepository


class AdapterImports:
    def __init__(self, repository: AdapterRepository, policy: ImportPolicy):
        self.repository = repository
        self.policy = policy

    def import_adapter(self, uri: str, name: str, owner: str, visibility: int) -> AdapterRegistration:
        """Blocking (network, disk, hashing): run it in a worker thread."""
        check_name("name", name)
        check_name("owner", owner)
        self.policy.check(owner, uri)
        # The tenant's room (for another adapter unless the name holds one, which a new version
        # replaces) and one of its upload slots, before the source is read.
        new_adapter = self.repository.catalog.get_by_name(owner, name) is None
        admission = self.repository.quota.admit(owner, new_adapter)
        try:
            files = fetch_adapter_files(open_source(uri), self.repository.limits.max_adapter_bytes)
            # The weights stay in the page-aligned memory they were read into; the small files
            # are parsed as bytes.
            tokenizer_files = {
                n: bytes(data) for n, data in files.items() if n not in (CONFIG_FILE, WEIGHTS_FILE)
            }
            return self.repository.registrar.register_version(
                AdapterUpload(
                    name, owner, visibility, bytes(files[CONFIG_FILE]), files[WEIGHTS_FILE], tokenizer_files
                )
            )
        finally:
            admission.release()
