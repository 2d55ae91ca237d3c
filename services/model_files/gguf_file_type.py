"""A GGUF file's ``general.file_type``: the format most of its tensors are stored in, read from
the header's key-value section alone.

The gguf package's reader parses the whole header, the tokenizer's vocabulary with it, which
takes seconds; this stops at the one key, which converters write before the tokenizer's arrays.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
FILE_TYPE_KEY = "general.file_type"
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 32: "bf16"}
"""llama.cpp's ``LLAMA_FTYPE_*`` values by name; other values read as ``other``."""

_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each GGUF scalar value type (uint8 … float64, bool)."""


def gguf_file_type(path: str | Path) -> str:
    """``f32``, ``f16``, ``bf16``, ``q4_0``, ``q4_1``, ``q8_0``, ``other``, or ``unknown`` when
    the header has no ``general.file_type``; ValueError for a file that is not GGUF v2 or v3."""
    with open(path, "rb") as f:
        magic, version, _tensors, keys = struct.unpack("<4sIQQ", f.read(24))
        if magic != MAGIC or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        for _ in range(keys):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            if key == FILE_TYPE_KEY and value_type in _SCALAR_SIZES:
                size = _SCALAR_SIZES[value_type]
                return FILE_TYPES.get(int.from_bytes(f.read(size), "little"), "other")
            _skip_value(f, value_type)
    return "unknown"


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        _read_string(f)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item_type] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[value_type], 1)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")
