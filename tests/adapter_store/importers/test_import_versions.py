"""Re-importing a name: unchanged content is kept, changed content is the next version."""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import TENANT, stored, write_dir
from support.blob_collection import collect_unreferenced_blobs

from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.import_policy import load_import_policy
from services.runtime.errors import InvalidArgument


def test_reimport_keeps_unchanged_and_versions_changed_content(tmp_path, imports, repository, small_adapter):
    directory = write_dir(tmp_path / "a", small_adapter(0))
    source = imports(f"file://{tmp_path}")
    first = source.import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    same = source.import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    assert (same.changed, same.record) == (False, first.record)

    new_weights = small_adapter(1)["adapter_model.safetensors"]
    (directory / "adapter_model.safetensors").write_bytes(new_weights)
    changed = source.import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    assert changed.changed and changed.record.version == 2 and changed.record.id != first.record.id
    assert changed.record.sha256 == hashlib.sha256(new_weights).hexdigest() != first.record.sha256
    assert stored(repository) == {"rows": 1, "blobs": 3}  # the config blob is the versions' one
    # The old version is kept (--keep-versions): its weights stay until it is pruned.
    assert collect_unreferenced_blobs(repository) == 0
    assert [r.version for r in repository.retention.versions(TENANT, "a")] == [1, 2]
    assert bytes(repository.read_weights(changed.record)) == new_weights


def test_invalid_adapter_is_refused_as_an_upload_is(tmp_path, imports, repository, small_adapter):
    files = dict(small_adapter())
    config = json.loads(files["adapter_config.json"])
    files["adapter_config.json"] = json.dumps(config | {"modules_to_save": ["lm_head"]}).encode()
    write_dir(tmp_path / "a", files)
    with pytest.raises(InvalidArgument, match="modules_to_save"):
        imports(f"file://{tmp_path}").import_adapter(f"file://{tmp_path}/a", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_policy_file_format(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps({"tenants": {"alice": ["s3://team/adapters", "hf://my-org", "file:///srv/a"]}})
    )
    policy = load_import_policy(str(path))
    assert policy.check("alice", "s3://team/adapters/x").segments == ("team", "adapters", "x")
    policy.check("alice", "hf://my-org/repo@v1/sub")
    assert load_import_policy("").grants == {}
    path.write_text(json.dumps({"tenants": {"alice": ["http://example.com/x"]}}))
    with pytest.raises(ValueError, match="tenant 'alice'.*http://example.com/x"):
        load_import_policy(str(path))
