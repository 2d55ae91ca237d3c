"""Fuzzing every gRPC method on the gateway's port: every service its reflection lists (the
public ``loramesh.v1.Gateway``, ``grpc.health.v1.Health``, the reflection service itself), every
method read from the proto descriptors.

The system under test is the gateway's input handling, on a real gateway service (its server,
the shared interceptor, its core, a real adapter store) in front of a fake worker that cannot
fail (tests/support/fuzz_gateway.py). For each method, derandomized with a fixed example budget:

- messages built by hypothesis from the method's request descriptor: every field may be set, to
  its type's extremes (integers at their limits, NaN and infinities, enum numbers no enum
  names), long and odd text, random bytes, long repeated fields and maps, nested messages;
  adapter-like strings are often real names (alice's own adapter, bob's public and private
  ones), so the calls get past the lookups; with alice's API key, another, or none;
- random bytes, or a valid message cut or with a byte changed, as the serialized request.

Every call must end with a clear status: OK, or any code but UNKNOWN, INTERNAL and DATA_LOSS
(and never RESOURCE_EXHAUSTED for a size limit of gRPC's own, which would tell the caller to
retry later), within :data:`CALL_TIMEOUT_S`; no answer to alice may contain bob's private
adapter (its name or id) unless her request named it. Afterwards the gateway still serves a
valid request. The counts are printed at the end (past pytest's capture) and quoted in
docs/security.md, "Fuzzing".
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2  # noqa: F401  (its descriptors in the pool)
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cli import COMMAND_TIMEOUT_S
from support.fuzz_gateway import ALICE_KEY, ALICE_OWN, BOB_PRIVATE, BOB_PUBLIC, FUZZ, FuzzGateway, Tally

from bench.fuzz import grpc_calls
from bench.fuzz.grpc_calls import UNCLEAR
from bench.fuzz.proto_messages import Vocabulary, messages, raw_requests
from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

CALL_TIMEOUT_S = COMMAND_TIMEOUT_S
"""Not a timing claim: turns a hung call into a named failure."""
MESSAGE_EXAMPLES = 100
"""Structured requests per method."""
RAW_EXAMPLES = 30
"""Byte-level requests per method."""
MODELS = st.sampled_from(
    ["", ALICE_OWN, f"alice/{ALICE_OWN}", f"bob/{BOB_PUBLIC}", f"bob/{BOB_PRIVATE}", BOB_PRIVATE, "nope", "bob/",
     "/", "alice", "bob", "a" * 300]
)  # fmt: skip
KEYS = st.one_of(
    st.just(f"Bearer {ALICE_KEY}"),
    st.sampled_from([None, "", "Bearer ", "Bearer wrong", f"bearer {ALICE_KEY}", "Basic a2V5"]),
)
"""``authorization`` metadata: alice's key half the time (to get past it), never bob's."""
VOCABULARY = Vocabulary(names=MODELS)
"""Adapter-like fields often name real adapters (bench/fuzz/proto_messages.py builds the rest)."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, base_spec):
    with FuzzGateway.with_sample_adapter(tmp_path_factory.mktemp("fuzz-grpc"), base_spec) as running:
        yield running


@pytest.fixture(scope="module")
def channel(gateway):
    with grpc.insecure_channel(gateway.address) as channel:
        yield channel


def listed_services(channel: grpc.Channel) -> list[str]:
    """The services the gateway's reflection lists."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [reply] = list(stub.ServerReflectionInfo(iter([request]), timeout=CALL_TIMEOUT_S))
    return sorted(s.name for s in reply.list_services_response.service)


def public_methods(channel: grpc.Channel) -> list[MethodDescriptor]:
    pool = descriptor_pool.Default()
    return [m for name in listed_services(channel) for m in pool.FindServiceByName(name).methods]


def call(channel: grpc.Channel, method: MethodDescriptor, requests: list[bytes], metadata) -> tuple:
    """``(code, details, reply bytes)`` of one call with ``requests`` already serialized."""
    return grpc_calls.call(channel, method, requests, metadata, CALL_TIMEOUT_S)


def assert_clear(gateway: FuzzGateway, target: str, outcome: tuple, asked: bytes) -> None:
    code, details, reply = outcome
    assert code not in UNCLEAR, f"{target}: {code.name} {details[:300]!r}\nasked: {asked[:1000]!r}"
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{target}: no answer within {CALL_TIMEOUT_S} s"
    assert not (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata" in details), (
        f"{target}: a transport limit reported as a quota: {details[:300]!r}\nasked: {asked[:1000]!r}"
    )
    leaked = gateway.leaked(reply + details.encode(), asked)
    assert not leaked, f"{target}: another tenant's {leaked} in {reply[:300]!r} {details[:300]!r}"


def metadata_for(key: str | None) -> tuple:
    return () if key is None else (("authorization", key),)


def test_the_gateway_port_lists_the_public_services(channel):
    assert listed_services(channel) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "loramesh.v1.Gateway",
    ]
    gateway = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert {m.name for m in public_methods(channel)} >= {m.name for m in gateway.methods}


def fuzz_method(gateway: FuzzGateway, channel: grpc.Channel, tally: Tally, method: MethodDescriptor) -> None:
    target = f"{method.containing_service.name}/{method.name}"
    count = st.integers(0, 3) if method.client_streaming else st.just(1)

    @settings(FUZZ, max_examples=MESSAGE_EXAMPLES)
    @given(st.lists(messages(method.input_type, VOCABULARY), min_size=1, max_size=3), count, KEYS)
    def structured(requests, how_many, key):
        serialized = [m.SerializeToString() for m in requests][:how_many]
        outcome = call(channel, method, serialized, metadata_for(key))
        tally.add(target, outcome[0].name)
        assert_clear(gateway, target, outcome, b"".join(serialized) + str(key).encode())

    @settings(FUZZ, max_examples=RAW_EXAMPLES)
    @given(raw_requests(method.input_type, VOCABULARY), KEYS)
    def raw(request_bytes, key):
        outcome = call(channel, method, [request_bytes], metadata_for(key))
        tally.add(target + " (bytes)", outcome[0].name)
        assert_clear(gateway, target, outcome, request_bytes + str(key).encode())

    structured()
    raw()


def test_every_method_with_hypothesis_built_messages(request, gateway, channel):
    tally = Tally("gRPC, hypothesis (messages from the proto descriptors, and raw bytes)")
    for method in public_methods(channel):
        fuzz_method(gateway, channel, tally, method)
    still_serves(gateway, channel)
    tally.report(request.config)


def still_serves(gateway: FuzzGateway, channel: grpc.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    replies = list(
        stub.Chat(
            gateway_pb2.ChatRequest(
                messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
                sampling=types_pb2.SamplingParams(max_tokens=2),
            ),
            metadata=metadata_for(f"Bearer {ALICE_KEY}"),
            timeout=CALL_TIMEOUT_S,
        )
    )
    assert replies[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
