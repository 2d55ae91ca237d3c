"""A base-model weight kept in a GGUF block format (Q4_1 or Q8_0) and multiplied as it is.

The blocks are llama.cpp's own bytes (each row: ``in_features / 32`` blocks), so a GGUF's
quantized tensors are served without converting them, and the weights the kernel multiplies are
bit for bit gguf-py's dequantization of those bytes (``kernels/cpu_quant_matmul.c``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from services.gpu_worker.kernels import cpu_quant

BLOCK_WEIGHTS = 32
"""Weights per block, in both formats."""
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
"""Bytes per block: Q4_1 = fp16 scale + fp16 minimum + 16 bytes of 4-bit values; Q8_0 = fp16
scale + 32 int8 values."""
GGML_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
"""The GGUF tensor type of each format."""


@dataclass(frozen=True)
class QuantizedWeight:
    """``[out_features, in_features]`` weights as rows of quantized blocks."""

    blocks: torch.Tensor
    """uint8 ``[out_features, in_features / 32 * BLOCK_BYTES[format]]``, contiguous, on the CPU."""
    format: str
    """``q4_1`` or ``q8_0``."""
    in_features: int
    """Columns of the dequantized matrix (a multiple of 32)."""

    def __post_init__(self):
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {self.format!r} (known: {', '.join(BLOCK_BYTES)})")
        if self.in_features % BLOCK_WEIGHTS:
            raise ValueError(
                f"{self.format} needs in_features to be a multiple of 32, not {self.in_features}"
            )
        expected = self.in_features // BLOCK_WEIGHTS * BLOCK_BYTES[self.format]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != expected:
            raise ValueError(f"{self.format} rows of {self.in_features} weights are {expected} uint8 bytes")

    @cached_property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``; kept: a step asks it of every projection it runs."""
        return (self.blocks.shape[0], self.in_features)

    def numel(self) -> int:
        return self.blocks.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes read to multiply by this weight once."""
        return self.blocks.numel()

    @classmethod
    def from_gguf_rows(cls, rows: np.ndarray, format: str) -> QuantizedWeight:
        """From a GGUF tensor's raw ``[out_features, bytes per row]`` uint8 data."""
        # A file's tensors are read-only views of its memory map: copy those.
        blocks = torch.from_numpy(np.array(rows, dtype=np.uint8, order="C", copy=not rows.flags.writeable))
        return cls(blocks, format, rows.shape[1] // BLOCK_BYTES[format] * BLOCK_WEIGHTS)

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str) -> QuantizedWeight:
        """``weight`` [out, in] quantized as llama.cpp's reference quantizer (gguf-py) does."""
        data = quantize(weight.detach().float().cpu().numpy(), GGML_TYPES[format])
        return cls.from_gguf_rows(data, format)

    @classmethod
    def cat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of ``weights`` one after the other (one format, one width)."""
        first = weights[0]
        if any(w.format != first.format or w.in_features != first.in_features for w in weights):
            raise ValueError("only weights of one format and width can be concatenated")
        return cls(torch.cat([w.blocks for w in weights]), first.format, first.in_features)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix (gguf-py's dequantization: what transformers runs for this GGUF)."""
        return torch.from_numpy(dequantize(self.blocks.numpy(), GGML_TYPES[self.format]).astype(np.float32))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for ``x`` [T, in], in ``out_dtype`` (math in fp32)."""
        out = torch.empty(x.shape[0], self.blocks.shape[0], dtype=out_dtype)
        cpu_quant.prepare_linear(x, self.blocks, self.format, self.blocks.shape[0], bias, out).run()
        return out

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """The fp32 rows ``indices`` (an embedding lookup)."""
        return cpu_quant.rows(self.blocks, self.format, self.in_features, indices)
