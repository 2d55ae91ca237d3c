"""hf:// imports through huggingface_hub's own calls, against a loopback Hub mirror, then offline.

``HF_ENDPOINT`` points at :mod:`support.hub_mirror`, so ``hf_hub_download`` makes exactly the
HEAD and GET requests it makes against huggingface.co, and fills a real ``HF_HOME`` cache; with
``HF_HUB_OFFLINE=1`` the same calls are then served from that cache alone.
"""

from __future__ import annotations

import hashlib

import pytest
from conftest import MAX_ADAPTER_BYTES, TENANT, stored
from support.hub_mirror import MirrorRepo

from services.adapter_store.adapter_record import PRIVATE
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted


def test_import_from_a_subdirectory_at_a_revision_then_offline(
    hub, imports, repository, small_adapter, monkeypatch
):
    files = small_adapter()
    template = b"{{ messages[0]['content'] }}"
    hub.repos["my-org/adapters"] = MirrorRepo(
        {f"sql/{n}": d for n, d in files.items()} | {"sql/chat_template.jinja": template, "README.md": b"hi"}
    )
    commit = hub.repos["my-org/adapters"].commit
    allowed = imports("hf://my-org")
    registration = allowed.import_adapter(f"hf://my-org/adapters@{commit}/sql", "sql", TENANT, PRIVATE)
    record = registration.record
    assert record.sha256 == hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()
    assert record.chat_template == template.decode()
    assert sorted(hub.repos["my-org/adapters"].gets) == sorted(
        ["sql/adapter_config.json", "sql/adapter_model.safetensors", "sql/chat_template.jinja"]
    )  # just the adapter's files, not the repository

    hub.close()  # the Hub is gone: the cache serves the same calls
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = allowed.import_adapter(f"hf://my-org/adapters@{commit}/sql", "sql", TENANT, PRIVATE)
    assert (again.changed, again.record.id) == (False, record.id)
    with pytest.raises(NotFound, match="not in the Hub cache"):
        allowed.import_adapter("hf://my-org/never-downloaded", "x", TENANT, PRIVATE)


def test_missing_repo_is_not_found_and_a_non_adapter_is_invalid(hub, imports, repository, small_adapter):
    hub.repos["my-org/a-model"] = MirrorRepo({"config.json": b"{}", "model.safetensors": b"x"})
    allowed = imports("hf://my-org")
    with pytest.raises(NotFound, match="'my-org/missing' not found"):
        allowed.import_adapter("hf://my-org/missing", "a", TENANT, PRIVATE)
    with pytest.raises(InvalidArgument, match="not a PEFT adapter.*adapter_config.json"):
        allowed.import_adapter("hf://my-org/a-model", "a", TENANT, PRIVATE)
    hub.repos["my-org/adapter"] = MirrorRepo(small_adapter())
    with pytest.raises(NotFound, match="revision 'no-such-branch'"):
        allowed.import_adapter("hf://my-org/adapter@no-such-branch", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_other_organisations_are_refused(hub, imports, repository, small_adapter):
    hub.repos["their-org/adapter"] = MirrorRepo(small_adapter())
    with pytest.raises(PermissionDenied, match="hf://their-org/adapter"):
        imports("hf://my-org").import_adapter("hf://their-org/adapter", "a", TENANT, PRIVATE)
    assert hub.repos["their-org/adapter"].gets == []


def test_oversized_file_is_refused_before_download(hub, imports, repository, small_adapter):
    files = dict(small_adapter())
    files["adapter_model.safetensors"] = b"\0" * (MAX_ADAPTER_BYTES + 1)
    hub.repos["my-org/big"] = MirrorRepo(files)
    with pytest.raises(ResourceExhausted, match="adapter_model.safetensors"):
        imports("hf://my-org").import_adapter("hf://my-org/big", "a", TENANT, PRIVATE)
    assert hub.repos["my-org/big"].gets == [] and stored(repository) == {"rows": 0, "blobs": 0}
