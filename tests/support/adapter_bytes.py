"""Byte-level edits of PEFT adapter files, for tests that feed the store bad input."""

from __future__ import annotations

import json
import struct


def with_config(config: bytes, **changes) -> bytes:
    """The config with fields replaced (a value of ``...`` removes the field)."""
    parsed = json.loads(config)
    for key, value in changes.items():
        if value is ...:
            parsed.pop(key)
        else:
            parsed[key] = value
    return json.dumps(parsed).encode()


def split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header and data section."""
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict, body: bytes) -> bytes:
    """A safetensors file from a header and a data section, the header padded to 8 bytes."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def poke(data: bytes, name: str, element: int, bits: int) -> bytes:
    """Overwrite one element of a tensor with raw bits (works for every dtype, bf16 included).

    A negative ``element`` counts from the end of the tensor.
    """
    header, body = split(data)
    info = header[name]
    size = {"F16": 2, "BF16": 2, "F32": 4}[info["dtype"]]
    data_start = len(data) - len(body)
    anchor = info["data_offsets"][1] if element < 0 else info["data_offsets"][0]
    at = data_start + anchor + element * size
    out = bytearray(data)
    out[at : at + size] = bits.to_bytes(size, "little")
    return bytes(out)
