"""A PEFT file converted into an adapter's rows whole: the same factors, bit for bit, as each
tensor read and converted on its own, whether the file arrives whole or in chunks, and a file
laid out otherwise read tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.gpu_worker.lora.host_adapter import parse_peft_adapter
from services.gpu_worker.lora.paired_rows import host_dtype, paired_rows
from services.model_files.base_model import BaseModelSpec
from services.model_files.peft_format import LORA_TARGETS, parse_tensor_name, tensor_name
from services.runtime.errors import InvalidArgument

SPEC = BaseModelSpec(
    name="tiny", hidden_size=32, intermediate_size=48, num_layers=12, num_heads=4, num_kv_heads=2,
    head_dim=8, vocab_size=64,
)  # fmt: skip
CONFIG = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": list(LORA_TARGETS)})


def _weights(tmp_path, file_dtype: str, **sample) -> bytes:
    spec = SampleAdapterSpec(rank=4, target_modules=LORA_TARGETS, dtype=file_dtype, seed=7, **sample)
    return (write_peft_adapter(tmp_path, SPEC, spec) / "adapter_model.safetensors").read_bytes()


def _expected(weights: bytes, dtype: torch.dtype) -> dict:
    """Each module's (A, Bᵀ) as ``safetensors`` reads them, converted one by one."""
    pairs: dict = {}
    for name, tensor in load(weights).items():
        layer, module, factor = parse_tensor_name(name)
        pairs.setdefault((layer, module), {})[factor] = tensor
    return {key: (f["A"].to(dtype), f["B"].t().to(dtype)) for key, f in pairs.items()}


def _assert_same_factors(
    adapter, expected: dict, dtype: torch.dtype, held: torch.dtype | None = None
) -> None:
    """``adapter``'s factors, held in ``held`` (default ``dtype``), are ``expected`` once in ``dtype``."""
    held = held or dtype
    assert set(adapter.modules) == set(expected)
    offset = 0
    for key, factors in adapter.modules.items():  # views of the rows, back to back in their order
        for matrix, want in zip((factors.a, factors.b_t), expected[key], strict=True):
            assert matrix.dtype == held and matrix.is_contiguous() and torch.equal(matrix.to(dtype), want), (
                key
            )
            assert matrix.data_ptr() == adapter.rows.data_ptr() + offset * held.itemsize
            offset += matrix.numel()
    assert offset == adapter.rows.numel()


@pytest.mark.parametrize("file_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rows_hold_each_factor_as_converted_alone(tmp_path, file_dtype, dtype):
    # Layers 0..11: the file holds them as 0, 1, 10, 11, 2, ... (sorted names).
    weights = _weights(tmp_path, file_dtype, rank_pattern={r"layers\.3\.": 2, "down_proj": 8})
    assert paired_rows(weights, dtype) is not None
    _assert_same_factors(parse_peft_adapter("a", CONFIG, weights, dtype), _expected(weights, dtype), dtype)
    held = host_dtype(getattr(torch, file_dtype), dtype)
    narrowed = parse_peft_adapter("a", CONFIG, weights, dtype, narrow=True)
    _assert_same_factors(narrowed, _expected(weights, dtype), dtype, held)


@pytest.mark.parametrize(
    ("file_dtype", "dtype", "held"),
    [
        (torch.float16, torch.float32, torch.float16),  # exact at the page-in, half the bytes
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16, torch.bfloat16),  # rounds: once, at the parse
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32, torch.float32),
    ],
)
def test_a_host_copy_keeps_the_files_dtype_only_where_the_pools_conversion_is_exact(file_dtype, dtype, held):
    assert host_dtype(file_dtype, dtype) == held


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4096, 10**6])
def test_a_file_in_chunks_gives_the_rows_of_the_whole_file(tmp_path, chunk_bytes):
    """A B that straddles two chunks is read from its bytes joined; the rest from the chunks."""
    weights = _weights(tmp_path, "float16")
    chunks = [weights[i : i + chunk_bytes] for i in range(0, len(weights), chunk_bytes)]
    whole = paired_rows(weights, torch.float32)
    chunked = paired_rows(chunks, torch.float32)
    assert chunked is not None and chunked.modules == whole.modules
    assert torch.equal(chunked.rows, whole.rows)


def test_chunks_that_split_an_element_are_read_tensor_by_tensor(tmp_path):
    weights = _weights(tmp_path, "float16")
    chunks = [weights[i : i + 7] for i in range(0, len(weights), 7)]
    assert paired_rows(chunks, torch.float32) is None
    adapter = parse_peft_adapter("a", CONFIG, chunks, torch.float32)
    _assert_same_factors(adapter, _expected(weights, torch.float32), torch.float32)


def _file(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A safetensors file holding ``tensors`` in this order (``safetensors`` itself sorts them)."""
    header, position, payload = {}, 0, []
    for name, tensor in tensors:
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = {torch.float16: "F16", torch.float32: "F32"}[tensor.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [position, position + len(raw)],
        }
        payload.append(raw)
        position += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded + b"".join(payload)


@pytest.mark.parametrize(
    "layout",
    ["b before a", "a module's factors apart", "two dtypes"],
)
def test_a_file_not_laid_out_in_pairs_is_read_tensor_by_tensor(layout):
    generator = torch.Generator().manual_seed(1)
    q_a, q_b = torch.randn(4, 32, generator=generator).half(), torch.randn(32, 4, generator=generator).half()
    v_a, v_b = torch.randn(4, 32, generator=generator).half(), torch.randn(16, 4, generator=generator).half()
    names = [tensor_name(0, "q_proj", "A"), tensor_name(0, "q_proj", "B")]
    names += [tensor_name(0, "v_proj", "A"), tensor_name(0, "v_proj", "B")]
    tensors = list(zip(names, (q_a, q_b, v_a, v_b), strict=True))
    if layout == "b before a":
        tensors[0], tensors[1] = tensors[1], tensors[0]
    elif layout == "a module's factors apart":
        tensors[1], tensors[2] = tensors[2], tensors[1]
    else:
        tensors[3] = (tensors[3][0], v_b.float())
    weights = _file(tensors)
    assert paired_rows(weights, torch.float32) is None
    adapter = parse_peft_adapter("a", CONFIG, weights, torch.float32)
    expected = {(0, "q_proj"): (q_a.float(), q_b.t().float()), (0, "v_proj"): (v_a.float(), v_b.t().float())}
    _assert_same_factors(adapter, expected, torch.float32)


def test_a_file_laid_out_in_pairs_reads_as_safetensors_writes_it():
    """The hand-written file of the test above, in pairs: read whole, as ``safetensors``' own."""
    generator = torch.Generator().manual_seed(2)
    tensors = {tensor_name(0, "q_proj", "A"): torch.randn(4, 32, generator=generator).half()}
    tensors[tensor_name(0, "q_proj", "B")] = torch.randn(32, 4, generator=generator).half()
    mine, theirs = _file(list(tensors.items())), save(tensors)
    assert torch.equal(paired_rows(mine, torch.float32).rows, paired_rows(theirs, torch.float32).rows)
    with_trailing_bytes = paired_rows(mine + b"\0" * 6, torch.float32)  # not the tensors': not read
    assert torch.equal(with_trailing_bytes.rows, paired_rows(theirs, torch.float32).rows)


def test_a_file_cut_short_is_refused_naming_the_tensor(tmp_path):
    weights = _weights(tmp_path, "float16")
    with pytest.raises(InvalidArgument, match="bad data offsets"):
        parse_peft_adapter("a", CONFIG, weights[:-2], torch.float32)
