"""API keys held and stored only as salted hashes; a plain key in a file still works."""

from __future__ import annotations

import json

import pytest

from services.gateway.auth import ApiKeys, hash_api_key, hashed_keys
from services.runtime.errors import InvalidArgument, Unauthenticated


def test_a_hashed_key_authenticates_and_reveals_nothing(tmp_path):
    key = "lm-admin-Zx81ZkQ3"
    stored = hash_api_key(key)
    assert key not in stored and stored != hash_api_key(key)  # salted: a new hash every time
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({stored: "admin", "plain-key-bob": "bob"}))
    keys = ApiKeys.from_config("", str(path))
    assert keys.tenant_for(f"Bearer {key}") == "admin"
    assert keys.tenant_for("Bearer plain-key-bob") == "bob"
    with pytest.raises(Unauthenticated, match="invalid API key"):
        keys.tenant_for("Bearer lm-admin-wrong")
    assert "plain-key-bob" not in repr(vars(keys))


def test_hashed_keys_hashes_plain_entries_and_keeps_hashed_ones():
    stored = hash_api_key("k1")
    out = hashed_keys({stored: "a", "k2": "b"})
    assert out[stored] == "a" and "k2" not in out
    assert ApiKeys(out).tenant_for("Bearer k2") == "b"


def test_a_malformed_hash_is_refused_without_echoing_it():
    with pytest.raises(InvalidArgument, match="tenant 'alice'") as refused:
        ApiKeys({"sha256:zz:secretish": "alice"})
    assert "secretish" not in str(refused.value)
