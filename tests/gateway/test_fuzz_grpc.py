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
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2  # noqa: F401  (its descriptors in the pool)
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cli import COMMAND_TIMEOUT_S
from support.fuzz_gateway import ALICE_KEY, ALICE_OWN, BOB_PRIVATE, BOB_PUBLIC, FUZZ, FuzzGateway, Tally

from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

CALL_TIMEOUT_S = COMMAND_TIMEOUT_S
"""Not a timing claim: turns a hung call into a named failure."""
MESSAGE_EXAMPLES = 100
"""Structured requests per method."""
RAW_EXAMPLES = 30
"""Byte-level requests per method."""
MAX_DEPTH = 3
"""Nested messages built this deep at most."""
STREAM_REPLIES = 8
"""Replies read from a response stream before the call is cancelled."""
ENDLESS = {"grpc.health.v1.Health.Watch"}
"""Response streams that never end by design (a status, then each change): cancelled after
their first reply."""
UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
"""Codes that say the server failed rather than why the request was refused."""

MODELS = st.sampled_from(
    ["", ALICE_OWN, f"alice/{ALICE_OWN}", f"bob/{BOB_PUBLIC}", f"bob/{BOB_PRIVATE}", BOB_PRIVATE, "nope", "bob/",
     "/", "alice", "bob", "a" * 300]
)  # fmt: skip
NAMEISH = (
    "adapter",
    "name",
    "owner",
    "service",
    "file_containing_symbol",
    "file_by_filename",
    "list_services",
)
"""String fields that name something the gateway looks up: often given a real name."""
KEYS = st.one_of(
    st.just(f"Bearer {ALICE_KEY}"),
    st.sampled_from([None, "", "Bearer ", "Bearer wrong", f"bearer {ALICE_KEY}", "Basic a2V5"]),
)
"""``authorization`` metadata: alice's key half the time (to get past it), never bob's."""
ODD_TEXT = st.sampled_from(
    ["", "\x00", "\u202e\u2066abc", "🦜" * 1000, "a" * 100_000, "\n" * 5000, "{{ 7*7 }}", "<|im_end|>",
     "{% for x in range(10**9) %}{% endfor %}", "%s%n", "../../etc/passwd", "s3://bucket/x", "hf://a/b",
     "file:///etc", "loramesh.v1.Gateway", "grpc.health.v1.Health", "loramesh/v1/gateway.proto"]
)  # fmt: skip
TEXT = st.one_of(st.text(st.characters(exclude_categories=["Cs"]), max_size=40), ODD_TEXT)

INT_LIMITS = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, 0, 1, -1, 2**31 - 1, 49_152, 10**6) if low <= v <= high]
    return st.one_of(st.integers(low, high), st.sampled_from(edges))


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    kind = field.cpp_type
    if kind in INT_LIMITS:
        return _integers(*INT_LIMITS[kind])
    if kind == FieldDescriptor.CPPTYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.CPPTYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        return st.integers(-3, max(v.number for v in field.enum_type.values) + 3)  # proto3: open enums
    if kind == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\x00" * 300_000))
    if field.name in NAMEISH:
        return st.one_of(MODELS, TEXT)
    return TEXT


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        entries = st.dictionaries(scalar(key), field_values(value, depth), max_size=4)
        if key.cpp_type in INT_LIMITS and value.cpp_type == FieldDescriptor.CPPTYPE_FLOAT:  # logit_bias
            return st.one_of(entries, st.integers(1, 3).map(lambda k: {i: 1.0 for i in range(10_000 * k)}))
        return entries
    if field.message_type is not None:
        one = messages(field.message_type, depth + 1)
    else:
        one = scalar(field)
    if field.is_repeated:
        many = st.lists(one, max_size=4)
        if field.message_type is None:  # a long one (token ids, stop strings...), of one value
            many = st.one_of(
                many, st.tuples(one, st.sampled_from([3_000, 30_000])).map(lambda v: [v[0]] * v[1])
            )
        return many
    return one


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with any of its fields set to anything its type allows."""
    cls = GetMessageClass(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    optional = {field.name: field_values(field, depth) for field in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: build(cls, values))


def build(cls, values: dict) -> Message:
    message = cls()
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            target = getattr(message, name)
            for k, v in value.items():
                if isinstance(v, Message):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            getattr(message, name).extend(value)
        elif isinstance(value, Message):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


@st.composite
def raw_requests(draw, descriptor: Descriptor) -> bytes:
    """Bytes as the serialized request: random ones, or a valid message cut short or changed."""
    kind = draw(st.sampled_from(["random", "cut", "flipped"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    valid = draw(messages(descriptor)).SerializeToString()
    if not valid:
        return draw(st.binary(min_size=1, max_size=40))
    at = draw(st.integers(0, len(valid) - 1))
    if kind == "cut":
        return valid[:at]
    return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1 :]


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
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming:
        args = (iter(requests),)
    else:
        args = (requests[0],)
    kind = (
        ("stream" if method.client_streaming else "unary")
        + "_"
        + ("stream" if method.server_streaming else "unary")
    )
    callable_ = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    replies = []
    enough = 1 if method.full_name in ENDLESS else STREAM_REPLIES
    try:
        if method.server_streaming:
            stream = callable_(*args, metadata=metadata, timeout=CALL_TIMEOUT_S)
            for reply in stream:
                replies.append(reply)
                if len(replies) >= enough:
                    stream.cancel()
                    return grpc.StatusCode.OK, "", b"".join(replies)
            return stream.code(), stream.details() or "", b"".join(replies)
        reply = callable_(*args, metadata=metadata, timeout=CALL_TIMEOUT_S)
        return grpc.StatusCode.OK, "", reply
    except grpc.RpcError as error:
        return error.code(), error.details() or "", b"".join(replies)


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
    @given(st.lists(messages(method.input_type), min_size=1, max_size=3), count, KEYS)
    def structured(requests, how_many, key):
        serialized = [m.SerializeToString() for m in requests][:how_many]
        outcome = call(channel, method, serialized, metadata_for(key))
        tally.add(target, outcome[0].name)
        assert_clear(gateway, target, outcome, b"".join(serialized) + str(key).encode())

    @settings(FUZZ, max_examples=RAW_EXAMPLES)
    @given(raw_requests(method.input_type), KEYS)
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
