"""A publish is an upload with ``new_version`` set (issue 52, what ``client.adapters.publish``
sends): a name already registered gets its next version instead of ALREADY_EXISTS, and the same
content again changes nothing."""

from __future__ import annotations

import grpc
import pytest
from support.polling import HANG_GUARD_S

from mesh_api.adapter_transfer import ref_by_name
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import types_pb2
from services.adapter_store.repository import AdapterKey


def publish(stub, files, name="tuned") -> pb.RegisterAdapterResponse:
    messages = upload_wire(files, name, "alice", types_pb2.VISIBILITY_PRIVATE, new_version=True)
    return stub.RegisterAdapter(map(pb.RegisterAdapterRequest.FromString, messages), timeout=HANG_GUARD_S)


def test_a_publish_registers_a_name_then_its_next_versions(store_stub, seeded_files):
    first = publish(store_stub, seeded_files(1))
    assert first.changed and first.adapter.version == 1
    again = publish(store_stub, seeded_files(1))
    assert not again.changed and again.adapter.id == first.adapter.id
    second = publish(store_stub, seeded_files(2))
    assert second.changed and second.adapter.version == 2
    assert (second.adapter.id, second.adapter.sha256) != (first.adapter.id, first.adapter.sha256)
    serving = store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "tuned")))
    assert serving.id == second.adapter.id


@pytest.mark.store_config(tenants={"alice": {"max_adapters": 1}})
def test_a_publish_to_a_name_held_adds_a_version_not_an_adapter(store_stub, seeded_files):
    assert publish(store_stub, seeded_files(1)).adapter.version == 1
    assert publish(store_stub, seeded_files(2)).adapter.version == 2  # alice is at max_adapters 1
    with pytest.raises(grpc.RpcError) as refused:
        publish(store_stub, seeded_files(3), name="other")
    assert (
        refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "max_adapters 1" in refused.value.details()
    )


def test_a_published_versions_weights_are_in_the_ram_tier_before_its_row_commits(
    store_server, store_stub, seeded_files, monkeypatch
):
    """A worker starts pulling a new version when its row reaches the worker's etcd watch,
    before the commit returns: the RAM tier must already hold it, or that fetch reads the blob
    back and hashes it again. The very upload buffer is kept (a mapping), not a copy."""
    repository = store_server.service.repository
    registrar = repository.registrar
    register_version = registrar.register_version
    held_at_commit: list[bool] = []

    def observed(upload):
        held_at_commit.append(upload.sha256 in repository.ram)
        return register_version(upload)

    monkeypatch.setattr(registrar, "register_version", observed)
    first = publish(store_stub, seeded_files(1)).adapter
    second = publish(store_stub, seeded_files(2)).adapter
    assert held_at_commit == [True, True]
    hits, misses = repository.ram.hits, repository.ram.misses
    assert repository.read_weights(repository.resolve(AdapterKey(id=second.id))).obj is not None
    assert (repository.ram.hits, repository.ram.misses) == (hits + 1, misses)
    assert first.sha256 in repository.ram  # the name's first version was put there too


def test_a_refused_publish_leaves_nothing_in_the_ram_tier(store_server, store_stub, seeded_files):
    repository = store_server.service.repository
    files = dict(seeded_files(3))
    files["adapter_config.json"] = files["adapter_config.json"].replace(b'"LORA"', b'"IA3"')
    with pytest.raises(grpc.RpcError) as refused:
        publish(store_stub, files)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(repository.ram) == 0
