"""`up`'s copy of ``--api-keys-file`` for its gateways: keys hashed, the admin key added, and kept
in step with the user's file; a bad edit keeps the copy in force."""

from __future__ import annotations

import json
import stat

import pytest

from loramesh_cli.gateway_keys_copy import GatewayKeysCopy
from services.gateway.auth import ApiKeys
from services.runtime.errors import InvalidArgument, Unauthenticated


def tenants(copy: GatewayKeysCopy) -> dict[str, str]:
    """Plain key -> tenant, as a gateway reading the copy authenticates them."""
    keys = ApiKeys(ApiKeys.read_file(str(copy.path)))
    known = {}
    for key in ("admin-key", "k-bob", "k-carol"):
        try:
            known[key] = keys.tenant_for(f"Bearer {key}")
        except Unauthenticated:
            pass
    return known


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k-bob": "bob"}))
    return path


def test_the_copy_holds_hashed_keys_and_follows_an_edit(tmp_path, source):
    copy = GatewayKeysCopy(tmp_path / "copy.json", "admin-key", "admin", source)
    copy.write()
    assert stat.S_IMODE(copy.path.stat().st_mode) == 0o600
    assert "k-bob" not in copy.path.read_text() and "admin-key" not in copy.path.read_text()
    assert tenants(copy) == {"admin-key": "admin", "k-bob": "bob"}

    before = copy.path.read_text()
    copy.refresh()  # unchanged source: the same copy
    assert copy.path.read_text() == before
    source.write_text(json.dumps({"k-carol": "carol"}))
    copy.refresh()
    assert tenants(copy) == {"admin-key": "admin", "k-carol": "carol"}


def test_a_bad_edit_keeps_the_copy_in_force(tmp_path, source):
    copy = GatewayKeysCopy(tmp_path / "copy.json", "admin-key", "admin", source)
    copy.write()
    before = copy.path.read_text()
    for broken in ('{"k-bob": ', json.dumps({"k-bob": 7})):
        source.write_text(broken)
        copy.refresh()
        assert copy.path.read_text() == before
    source.unlink()
    copy.refresh()
    assert copy.path.read_text() == before


def test_a_bad_file_at_start_is_refused_naming_it(tmp_path, source):
    source.write_text("not json")
    with pytest.raises(InvalidArgument, match="api-keys-file"):
        GatewayKeysCopy(tmp_path / "copy.json", "admin-key", "admin", source).write()
    assert not (tmp_path / "copy.json").exists()
