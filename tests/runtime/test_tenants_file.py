"""The tenants file both the gateways and the adapter store read: one parser, every limit."""

from __future__ import annotations

import json

import pytest

from services.runtime.errors import InvalidArgument
from services.runtime.tenants_file import QuotaConfig, TenantLimits, TenantsFile, read_tenant_limits


def test_the_stores_limits_are_read_beside_the_gateways_and_round_trip(tmp_path):
    tenants = {
        "alice": {"max_concurrent_requests": 2, "max_adapters": 10, "max_stored_bytes": 2**30},
        "*": {"max_concurrent_uploads": 4, "max_waiting_requests": 0},
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"keys": {"k": "alice"}, "tenants": tenants}))
    quotas = read_tenant_limits(str(path))
    assert quotas.for_tenant("alice") == TenantLimits(2, max_adapters=10, max_stored_bytes=2**30)
    assert quotas.for_tenant("bob").max_concurrent_uploads == 4
    assert quotas.for_tenant("alice").limits_storage and not quotas.for_tenant("bob").limits_storage
    # Unset limits are left out; a waiting room of 0 (nobody waits) is not unset.
    assert quotas.to_json()["tenants"] == tenants
    assert TenantsFile.parse(TenantsFile({"k": "alice"}, quotas).to_json()).quotas == quotas
    assert read_tenant_limits("") == QuotaConfig()


def test_a_bad_tenants_file_stops_the_store_naming_the_file_and_the_field(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"keys": {}, "tenants": {"alice": {"max_stored_bytes": -1}}}))
    with pytest.raises(
        ValueError, match=r"tenants.json: tenants\['alice'\].max_stored_bytes must be a whole"
    ):
        read_tenant_limits(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="tenants file .*tenants.json"):
        read_tenant_limits(str(path))
    with pytest.raises(InvalidArgument, match="unknown fields"):
        TenantLimits.parse("alice", {"max_bytes": 1})
