"""Hypothesis strategies for protobuf messages of any type, derived from its descriptor alone.

One generator over :class:`FieldDescriptor` types covers every request of every service: each
field may be set or not, to a value its type allows, often to its extremes (integers at their
limits and negative where the type is signed, NaN and infinities, enum numbers no enum names,
100,000-character strings, repeated fields of 30,000 items, maps of 10,000 entries, messages
nested :data:`MAX_DEPTH` deep). What a caller knows of its target goes in a :class:`Vocabulary`:
the names its lookups resolve (so calls get past them) and the text it finds odd.
:func:`raw_requests` gives bytes that do not parse as the type, or barely do.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_DEPTH = 3
"""Nested messages built this deep at most."""
DEEP_NESTING = 200
"""Levels of a length-delimited field inside itself in a raw request: past protobuf's recursion
limit (100), which a parser must refuse rather than overflow."""

MAX_REPEATED_BYTES = 16 * 2**20
"""A long repeated field stays under this: past gRPC's message limits already, and not gigabytes
for the client to build."""

INT_LIMITS = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}

ODD_TEXT = st.sampled_from(
    ["", "\x00", "\u202e\u2066abc", "🦜" * 1000, "a" * 100_000, "\n" * 5000, "{{ 7*7 }}", "<|im_end|>",
     "{% for x in range(10**9) %}{% endfor %}", "%s%n", "../../etc/passwd", "s3://bucket/x", "hf://a/b",
     "file:///etc", "loramesh.v1.Gateway", "grpc.health.v1.Health", "loramesh/v1/gateway.proto"]
)  # fmt: skip
"""Text no field expects: empty, NUL, bidi controls, huge, template syntax, paths and URIs."""

NAMEISH = frozenset(
    {"adapter", "adapter_id", "name", "owner", "service", "worker_id", "file_containing_symbol",
     "file_by_filename", "list_services"}
)  # fmt: skip
"""String fields that name something a service looks up: often given a :attr:`Vocabulary.names`."""


ANY_NAMES = st.sampled_from(["", "nope", "/", "a" * 300])
"""Names no target knows: what a :class:`Vocabulary` draws from unless told better."""


@dataclass(frozen=True)
class Vocabulary:
    """What the generated strings are drawn from."""

    names: st.SearchStrategy[str] = ANY_NAMES
    """Names the target resolves (adapters, owners, services), for :data:`NAMEISH` fields."""
    odd_text: st.SearchStrategy[str] = ODD_TEXT
    """Adversarial text, mixed with random text in every string field."""

    @property
    def text(self) -> st.SearchStrategy[str]:
        return st.one_of(st.text(st.characters(exclude_categories=["Cs"]), max_size=40), self.odd_text)


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, 0, 1, -1, 2**31 - 1, 49_152, 10**6) if low <= v <= high]
    return st.one_of(st.integers(low, high), st.sampled_from(edges))


def scalar(field: FieldDescriptor, vocabulary: Vocabulary) -> st.SearchStrategy:
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
        return st.one_of(vocabulary.names, vocabulary.text)
    return vocabulary.text


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def field_values(field: FieldDescriptor, depth: int, vocabulary: Vocabulary) -> st.SearchStrategy:
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        entries = st.dictionaries(scalar(key, vocabulary), field_values(value, depth, vocabulary), max_size=4)
        if key.cpp_type in INT_LIMITS and value.cpp_type == FieldDescriptor.CPPTYPE_FLOAT:  # logit_bias
            return st.one_of(entries, st.integers(1, 3).map(lambda k: {i: 1.0 for i in range(10_000 * k)}))
        return entries
    if field.message_type is not None:
        one = messages(field.message_type, vocabulary, depth + 1)
    else:
        one = scalar(field, vocabulary)
    if field.is_repeated:
        many = st.lists(one, max_size=4)
        if field.message_type is None:  # a long one (token ids, stop strings...), of one value
            many = st.one_of(many, st.tuples(one, st.sampled_from([3_000, 30_000])).map(_repeated))
        return many
    return one


def _repeated(value_and_count: tuple) -> list:
    """``value`` ``count`` times, or 3 times where that would pass :data:`MAX_REPEATED_BYTES`."""
    value, count = value_and_count
    size = len(value) if isinstance(value, (str, bytes)) else 8
    return [value] * (count if size * count <= MAX_REPEATED_BYTES else 3)


def messages(
    descriptor: Descriptor, vocabulary: Vocabulary = Vocabulary(), depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with any of its fields set to anything its type allows."""
    cls = GetMessageClass(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    optional = {field.name: field_values(field, depth, vocabulary) for field in descriptor.fields}
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def nested_bytes(field_number: int, levels: int) -> bytes:
    """Field ``field_number`` as a length-delimited record holding itself, ``levels`` deep."""
    tag = _varint(field_number << 3 | 2)
    inner = b""
    for _ in range(levels):
        inner = tag + _varint(len(inner)) + inner
    return inner


@st.composite
def raw_requests(draw, descriptor: Descriptor, vocabulary: Vocabulary = Vocabulary()) -> bytes:
    """Bytes as the serialized request: random ones, a valid message cut short or with a byte
    changed, or one of its fields nested :data:`DEEP_NESTING` deep."""
    kind = draw(st.sampled_from(["random", "cut", "flipped", "deep"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "deep":
        numbers = [f.number for f in descriptor.fields] or [1]
        return nested_bytes(draw(st.sampled_from(numbers)), DEEP_NESTING)
    valid = draw(messages(descriptor, vocabulary)).SerializeToString()
    if not valid:
        return draw(st.binary(min_size=1, max_size=40))
    at = draw(st.integers(0, len(valid) - 1))
    if kind == "cut":
        return valid[:at]
    return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1 :]
