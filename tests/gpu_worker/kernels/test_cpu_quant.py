"""The quantized-weight kernels (``cpu_quant_matmul.c``): every vector path this machine can run
(AVX-512 where the CPU has it, and AVX2 forced with ``-mno-avx512f``) multiplies exactly the
weights gguf-py's dequantization gives, and computes each row the same whatever its batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from services.gpu_worker.kernels import cpu_quant
from services.gpu_worker.model.quantized_weight import GGML_TYPES, QuantizedWeight


def _has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags and "avx512bw" in flags


ISAS = [
    "avx2",
    pytest.param(
        "native", marks=pytest.mark.skipif(not _has_avx512(), reason="the native path is the AVX2 one here")
    ),
]
FORMATS = ["q4_1", "q8_0"]


def _weight(fmt: str, rows: int = 70, cols: int = 96, seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    return QuantizedWeight.quantize(torch.randn(rows, cols, generator=generator) * 0.1, fmt)


@pytest.mark.parametrize("isa", ISAS)
def test_builds_the_asked_vector_path(isa):
    kernels = cpu_quant.kernels(isa)
    assert kernels.available, kernels.error
    assert kernels.isa == "avx2" if isa == "avx2" else kernels.isa.startswith("avx512")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_gguf_dequantization_bit_for_bit(isa, fmt):
    weight = _weight(fmt)
    reference = dequantize(weight.blocks.numpy(), GGML_TYPES[fmt]).astype(np.float32)
    indices = torch.tensor([0, 69, 3, 3])
    rows = cpu_quant.rows(weight.blocks, fmt, weight.in_features, indices, isa=isa)
    assert torch.equal(rows, torch.from_numpy(reference)[indices])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_dequantized_matmul(isa, fmt, x_dtype):
    weight = _weight(fmt)
    dense = weight.dequantize()
    if x_dtype == torch.bfloat16 and cpu_quant.kernels(isa).isa.endswith("+bf16"):
        dense = dense.bfloat16()  # vdpbf16ps: the weights rounded to bf16, as --dtype bfloat16 stores them
    dense = dense.double()
    bias = torch.randn(70)
    for rows in (1, 3, 5, 17, 130):  # register tiles and their edges; the widening path from 8 rows
        x = torch.randn(rows, 96).to(x_dtype)
        out = torch.empty(rows, 70)
        cpu_quant.prepare_linear(x, weight.blocks, fmt, 70, bias, out, isa=isa).run()
        expected = x.double() @ dense.T + bias.double()
        assert (out.double() - expected).abs().max().item() < 1e-4, (fmt, rows)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_one_hot_rows_read_back_the_weights_bit_for_bit(isa, fmt, x_dtype):
    # x = e_k gives column k of the weights the kernel multiplies, exactly: the fp32 dequantization,
    # or (vdpbf16ps) its bf16 rounding, however the kernel builds them (the bf16 path looks a Q4_1
    # block's 16 rounded values up by nibble).
    weight = _weight(fmt, seed=1)
    dense = weight.dequantize()
    if x_dtype == torch.bfloat16 and cpu_quant.kernels(isa).isa.endswith("+bf16"):
        dense = dense.bfloat16().float()
    for columns in ([37], [0, 95, 64, 31, 32], list(range(96))):  # one row, a register tile, widened rows
        x = torch.eye(96)[columns].to(x_dtype)
        out = torch.empty(len(columns), 70)
        cpu_quant.prepare_linear(x, weight.blocks, fmt, 70, None, out, isa=isa).run()
        assert torch.equal(out, dense[:, columns].T), (fmt, len(columns))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_in_any_batch(isa, fmt, x_dtype):
    weight = _weight(fmt, rows=100, cols=128)
    x = torch.randn(40, 128).to(x_dtype)
    alone = torch.empty(1, 100)
    cpu_quant.prepare_linear(x[7:8], weight.blocks, fmt, 100, None, alone, isa=isa).run()
    for rows in (8, 16, 40):  # in a register tile, and among rows that take the widening path
        batch = torch.empty(rows, 100)
        cpu_quant.prepare_linear(x[:rows], weight.blocks, fmt, 100, None, batch, isa=isa).run()
        assert torch.equal(batch[7], alone[0]), rows


def test_bad_shapes_are_refused_by_name():
    weight = _weight("q4_1")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(weight.blocks[:, :10], "q4_1", 20)
    with pytest.raises(ValueError, match="unknown block format"):
        QuantizedWeight(weight.blocks, "q3_k", 96)
    with pytest.raises(ValueError, match="rows"):
        cpu_quant.prepare_linear(
            torch.randn(2, 96), weight.blocks, "q4_1", 71, None, torch.empty(2, 71)
        ).run()
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([70]))
