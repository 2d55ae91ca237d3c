"""``FetchAdapter`` with the ``RAM_TIER_ONLY`` hint: sent from the RAM tier when the weights are
there, refused FAILED_PRECONDITION at once (no blob read) when they are not."""

from __future__ import annotations

import grpc
import pytest
from support.polling import HANG_GUARD_S

from mesh_api.adapter_transfer import ref_by_id, upload_requests
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import types_pb2
from services.runtime.rpc.fetch_hints import RAM_TIER_ONLY


def fetch_from_ram(stub, adapter_id: str) -> list[pb.FetchAdapterResponse]:
    request = pb.FetchAdapterRequest(ref=ref_by_id(adapter_id))
    return list(stub.FetchAdapter(request, timeout=HANG_GUARD_S, metadata=(RAM_TIER_ONLY,)))


def test_a_fetch_from_the_ram_tier_only_is_sent_when_the_weights_are_there(store_stub, seeded_files):
    files = seeded_files(1)
    wire = upload_wire(files, "tuned", "alice", types_pb2.VISIBILITY_PRIVATE, new_version=True)
    published = store_stub.RegisterAdapter(
        map(pb.RegisterAdapterRequest.FromString, wire), timeout=HANG_GUARD_S
    )
    misses = store_stub.Stats(pb.StatsRequest()).ram_misses
    messages = fetch_from_ram(store_stub, published.adapter.id)
    assert b"".join(m.chunk for m in messages[1:]) == files["adapter_model.safetensors"]
    assert store_stub.Stats(pb.StatsRequest()).ram_misses == misses


def test_a_fetch_from_the_ram_tier_only_is_refused_when_they_are_not(store_stub, seeded_files):
    registered = store_stub.RegisterAdapter(
        upload_requests(seeded_files(2), "cold", "alice"), timeout=HANG_GUARD_S
    )
    adapter_id = registered.adapter.id
    with pytest.raises(grpc.RpcError) as refused:
        fetch_from_ram(store_stub, adapter_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not in this replica's RAM tier" in refused.value.details()
    assert store_stub.Stats(pb.StatsRequest()).ram_misses == 0  # no blob read for it
