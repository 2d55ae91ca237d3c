"""A safetensors file's tensors read in place: the same tensors ``safetensors`` reads, and a clear
refusal for a file whose offsets do not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from services.gpu_worker.lora.safetensors_views import tensor_views
from services.runtime.errors import InvalidArgument


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_tensors_are_those_safetensors_reads(dtype):
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(4, 6, generator=generator).to(dtype),
        "b": torch.randn(7, generator=generator).to(dtype),
        "empty": torch.zeros(0, 3, dtype=dtype),
    }
    data = save(tensors)
    views = tensor_views(data)
    expected = load(data)
    assert sorted(views) == sorted(expected)
    for name, tensor in expected.items():
        assert views[name].dtype == dtype and views[name].shape == tensor.shape
        assert torch.equal(views[name], tensor)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 10**6])
def test_a_file_in_chunks_reads_as_the_file(chunk_bytes):
    generator = torch.Generator().manual_seed(5)
    tensors = {f"t{i}": torch.randn(3, 5, generator=generator).half() for i in range(6)}
    tensors["empty"] = torch.zeros(0, dtype=torch.float16)
    data = save(tensors)
    chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]
    views = tensor_views(chunks)
    assert sorted(views) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor)


def test_a_tensor_within_one_chunk_is_a_view_of_it():
    data = save({"a": torch.arange(12, dtype=torch.float16).reshape(3, 4)})
    chunks = [bytearray(data[:-24]), bytearray(data[-24:])]  # "a" is the last 24 bytes
    view = tensor_views(chunks)["a"]
    assert view.untyped_storage().data_ptr() == torch.frombuffer(chunks[1], dtype=torch.uint8).data_ptr()


def test_the_views_share_the_bytes():
    data = bytearray(save({"a": torch.arange(12, dtype=torch.float16).reshape(3, 4)}))
    view = tensor_views(data)["a"]
    assert view.untyped_storage().data_ptr() >= torch.frombuffer(data, dtype=torch.uint8).data_ptr()


def _with_header(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + payload


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02", "shorter than a safetensors header"),
        ((10**6).to_bytes(8, "little") + b"{}", "runs past the end"),
        ((2).to_bytes(8, "little") + b"{[", "not JSON"),
        (
            _with_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
            "bad data offsets",
        ),
        (
            _with_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 16),
            "bad data offsets",
        ),
    ],
)
def test_a_malformed_file_is_refused_with_what_is_wrong(data, message):
    with pytest.raises(InvalidArgument, match=message):
        tensor_views(data)
    with pytest.raises(InvalidArgument, match=message):  # the same file in chunks
        tensor_views([data[i : i + 3] for i in range(0, len(data), 3)])
