"""The AdapterStore gRPC API against a real server: happy paths, and every kind of bad input
answered with the right status and a message naming the problem, leaving no trace behind."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors
from support.adapter_bytes import poke, with_config
from support.blob_collection import collect_unreferenced_blobs

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_id, ref_by_name, upload_requests
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import types_pb2
from services.model_files.peft_format import tensor_name

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q_A = tensor_name(0, "q_proj", "A")


def register(stub, files, name="a1", owner="alice", visibility=types_pb2.VISIBILITY_PRIVATE):
    return stub.RegisterAdapter(upload_requests(files, name, owner, visibility), timeout=60).adapter


def fetch(stub, ref) -> tuple[pb.FetchAdapterResponse.Header, bytes]:
    messages = list(stub.FetchAdapter(pb.FetchAdapterRequest(ref=ref), timeout=60))
    assert messages[0].WhichOneof("item") == "header"
    assert all(len(m.chunk) <= 1 << 20 for m in messages[1:])
    return messages[0].header, b"".join(m.chunk for m in messages[1:])


def test_register_get_list_fetch_delete(store_stub, store_server, sample_files, traces):
    info = register(store_stub, sample_files, visibility=types_pb2.VISIBILITY_PUBLIC)
    assert (info.name, info.owner, info.rank, info.dtype) == ("a1", "alice", 8, "float16")
    assert info.sha256 == hashlib.sha256(sample_files[WEIGHTS]).hexdigest()
    assert info.base_model == "SmolLM2-135M-Instruct"
    assert list(info.target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]

    assert store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_id(info.id))) == info
    assert store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "a1"))) == info
    header, data = fetch(store_stub, ref_by_name("alice", "a1"))
    assert data == sample_files[WEIGHTS] and header.sha256 == info.sha256 and header.total_bytes == len(data)

    register(store_stub, sample_files, name="a1", owner="bob")  # same name, other owner: fine
    register(store_stub, sample_files, name="private", owner="bob")
    alice = store_stub.ListAdapters(pb.ListAdaptersRequest(owner="alice"))
    assert [a.name for a in alice.adapters] == ["a1"] and alice.total == 1
    carol = store_stub.ListAdapters(pb.ListAdaptersRequest(owner="carol", include_public=True))
    assert [(a.owner, a.name) for a in carol.adapters] == [("alice", "a1")]
    assert store_stub.ListAdapters(pb.ListAdaptersRequest()).total == 3

    deleted = store_stub.DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name("alice", "a1"))).adapter
    assert deleted.id == info.id
    with pytest.raises(grpc.RpcError) as err:
        store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_id(info.id)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and info.id in err.value.details()
    assert traces(store_server) == {"blobs": 2, "temp": 0, "rows": 2}
    again = register(store_stub, sample_files, name="a1", owner="alice")
    assert again.version == 2 and again.id != info.id


def test_list_pages_through_everything(store_stub, sample_files):
    for i in range(7):
        register(store_stub, sample_files, name=f"n{i}")
    names, token = [], ""
    while True:
        page = store_stub.ListAdapters(pb.ListAdaptersRequest(owner="alice", page_size=3, page_token=token))
        assert page.total == 7 and len(page.adapters) <= 3
        names += [a.name for a in page.adapters]
        token = page.next_page_token
        if not token:
            break
    assert names == [f"n{i}" for i in range(7)]
    with pytest.raises(grpc.RpcError) as err:
        store_stub.ListAdapters(pb.ListAdaptersRequest(page_token="garbage!"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.value.details()


def test_stats_and_request_id(store_server, store_stub, sample_files):
    info = register(store_stub, sample_files)
    fetch(store_stub, ref_by_id(info.id))  # into the RAM tier (registering leaves it as it was)
    stats = store_stub.Stats(pb.StatsRequest())
    assert (
        stats.adapters == 1 and stats.ram_bytes == len(sample_files[WEIGHTS]) and stats.uploads_in_flight == 0
    )
    load = store_server.service.load_report()  # what `loramesh status` shows, written every second
    assert (load["adapters"], load["ram_bytes"], load["catalog"]) == (1, len(sample_files[WEIGHTS]), "ok")
    _, call = store_stub.Stats.with_call(pb.StatsRequest(), metadata=(("x-request-id", "req-42"),))
    assert ("x-request-id", "req-42") in tuple(call.trailing_metadata())


# --- bad input: each refused with a clear status, nothing stored -----------------------------


def _to_int8(weights: bytes) -> bytes:
    return save_tensors({k: v.astype(np.int8) for k, v in load_tensors(weights).items()})


def _truncated(weights: bytes) -> bytes:
    return weights[: len(weights) - 1000]


def _header_too_long(weights: bytes) -> bytes:
    return struct.pack("<Q", len(weights) * 2) + weights[8:]


BAD_UPLOADS = {
    # case: (transform of (config, weights), status, words the message must contain)
    "truncated safetensors": (lambda c, w: (c, _truncated(w)), "INVALID_ARGUMENT", ["truncated"]),
    "header length larger than the file": (lambda c, w: (c, _header_too_long(w)), "INVALID_ARGUMENT", ["header"]),
    "lora on embed_tokens": (
        lambda c, w: (with_config(c, target_modules=["q_proj", "embed_tokens"]), w), "INVALID_ARGUMENT",
        ["embed_tokens"]),
    "lora on lm_head": (
        lambda c, w: (with_config(c, target_modules=["lm_head", "q_proj"]), w), "INVALID_ARGUMENT", ["lm_head"]),
    "modules_to_save": (
        lambda c, w: (with_config(c, modules_to_save=["lm_head"]), w), "INVALID_ARGUMENT", ["modules_to_save"]),
    "rank above the maximum": (lambda c, w: (with_config(c, r=128), w), "INVALID_ARGUMENT", ["128", "64"]),
    "NaN weights": (lambda c, w: (c, poke(w, Q_A, 5, 0x7E00)), "INVALID_ARGUMENT", ["NaN", Q_A]),
    "Inf weights": (lambda c, w: (c, poke(w, Q_A, 0, 0x7C00)), "INVALID_ARGUMENT", ["Inf", Q_A]),
    "integer dtype": (lambda c, w: (c, _to_int8(w)), "INVALID_ARGUMENT", ["I8"]),
    "config is not json": (lambda c, w: (b"{not json", w), "INVALID_ARGUMENT", ["adapter_config.json"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_upload_is_refused_and_leaves_no_trace(case, store_stub, store_server, sample_files, traces):
    register(store_stub, sample_files, name="keep")
    kept = traces(store_server)
    assert kept == {"blobs": 2, "temp": 0, "rows": 1}  # its weights and its config
    transform, code, needles = BAD_UPLOADS[case]
    config, weights = transform(sample_files[CONFIG], sample_files[WEIGHTS])
    with pytest.raises(grpc.RpcError) as err:
        register(store_stub, {CONFIG: config, WEIGHTS: weights}, name="bad")
    assert err.value.code().name == code, err.value.details()
    for needle in needles:
        assert needle in err.value.details(), err.value.details()
    assert traces(store_server) == kept
    names = [a.name for a in store_stub.ListAdapters(pb.ListAdaptersRequest()).adapters]
    assert names == ["keep"]


def test_shape_not_matching_the_base_model(store_stub, store_server, base_spec, tmp_path, traces):
    other = dataclasses.replace(base_spec, hidden_size=512)
    files = adapter_files(write_peft_adapter(tmp_path / "x", other, SampleAdapterSpec(rank=8)))
    with pytest.raises(grpc.RpcError) as err:
        register(store_stub, files)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape" in err.value.details() and "576" in err.value.details()
    assert traces(store_server) == {"blobs": 0, "temp": 0, "rows": 0}


def test_duplicate_name_for_the_same_owner(store_stub, store_server, sample_files, traces):
    first = register(store_stub, sample_files)
    with pytest.raises(grpc.RpcError) as err:
        register(store_stub, sample_files)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'a1'" in err.value.details()
    assert traces(store_server) == {"blobs": 2, "temp": 0, "rows": 1}
    assert store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "a1"))).id == first.id


@pytest.mark.store_config(max_adapter_mib=1)
def test_upload_over_the_size_limit(store_stub, store_server, sample_files, traces):
    assert len(sample_files[WEIGHTS]) > 1 << 20
    with pytest.raises(grpc.RpcError) as err:
        register(store_stub, sample_files)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "size limit" in err.value.details()
    assert traces(store_server) == {"blobs": 0, "temp": 0, "rows": 0}


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([pb.RegisterAdapterRequest(chunk=pb.RegisterAdapterRequest.FileChunk(filename=CONFIG, data=b"{}"))],
         "first message"),
        ([pb.RegisterAdapterRequest(header=pb.RegisterAdapterRequest.Header(name="x", owner="o"))],
         "adapter_config.json"),
        ([pb.RegisterAdapterRequest(header=pb.RegisterAdapterRequest.Header(name="bad name!", owner="o"))],
         "name"),
    ],
)  # fmt: skip
def test_malformed_upload_stream(messages, needle, store_stub, sample_files):
    if messages[0].header.name == "bad name!":
        messages = messages + list(upload_requests(sample_files, "x", "o"))[1:]
    with pytest.raises(grpc.RpcError) as err:
        store_stub.RegisterAdapter(iter(messages), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()


def test_unknown_adapter_is_not_found(store_stub):
    for call, request in [
        (store_stub.GetAdapter, pb.GetAdapterRequest(ref=ref_by_name("alice", "nope"))),
        (store_stub.DeleteAdapter, pb.DeleteAdapterRequest(ref=ref_by_id("0" * 32))),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        fetch(store_stub, ref_by_name("alice", "nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        store_stub.GetAdapter(pb.GetAdapterRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ref" in err.value.details()


# --- fuzzing: random and mutated bytes never crash the server nor leave a partial adapter -----

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        out[position % len(out)] = value
    return bytes(out[:cut] if cut is not None else out)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    payload=st.one_of(
        st.binary(max_size=4096).map(lambda b: ("random", b)),
        st.tuples(
            st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8),
            st.one_of(st.none(), st.integers(0, 4096)),
        ).map(lambda t: ("mutated", t)),
    ),
    target=st.sampled_from([CONFIG, WEIGHTS]),
)
def test_fuzzed_uploads_never_crash_nor_leave_partial_adapters(payload, target, store_stub, store_server,
                                                               sample_files, traces):  # fmt: skip
    files = dict(sample_files)
    kind, value = payload
    if kind == "random":
        files[target] = value
    else:
        edits, cut = value
        head = 2048 if target == WEIGHTS else len(files[target])  # the header region is where bugs hide
        files[target] = _mutate(files[target], [(p % head, v) for p, v in edits], cut)
    try:
        register(store_stub, files, name="fuzz")
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, (error.code(), error.details())
        assert traces(store_server) == {"blobs": 0, "temp": 0, "rows": 0}
    else:
        store_stub.DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name("alice", "fuzz")))
    collect_unreferenced_blobs(store_server.service.repository)
    assert traces(store_server) == {"blobs": 0, "temp": 0, "rows": 0}
    assert store_stub.Stats(pb.StatsRequest()).adapters == 0
