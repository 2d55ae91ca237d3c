"""Batch-invariant LoRA deltas (deterministic serving): a token's delta has the same bits alone
and inside any batch, whatever the other tokens of its adapter (which pick the native kernel's
streamed, tiled or two-phase path by default) and the other adapters (which set the Triton
kernels' tile shapes by default), for the native CPU kernel and for the Triton kernels in the CPU
interpreter, in fp32 and bf16. The Triton module is imported after ``TRITON_INTERPRET`` is set
(see test_lora_kernels.py); shapes stay small for the interpreter.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from services.gpu_worker.kernels.cpu_native import native_available
from services.gpu_worker.kernels.dispatch import add_lora_delta, resolve_backend
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments

IN_F, OUT_F = 96, 80
RANKS = (8, 16, 64)
DTYPES = [torch.float32, torch.bfloat16]


class Pool:
    """Adapters of RANKS scattered over a pool (rows in random slots, NaN elsewhere)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        slot = max(IN_F, OUT_F)
        rows = 2 * sum(RANKS)
        order = torch.randperm(2 * rows, generator=g)
        buffer = torch.full((2 * rows * slot,), float("nan"))
        taken = 0
        self.adapters: list[tuple[AdapterRows, float]] = []
        for rank in RANKS:
            offsets = []
            for width, count in ((IN_F, rank), (OUT_F, rank)):
                start = order[taken : taken + count] * slot
                taken += count
                for offset in start.tolist():
                    buffer[offset : offset + width] = torch.randn(width, generator=g) / width**0.5
                offsets.append(start.long())
            self.adapters.append((AdapterRows(offsets[0], offsets[1]), 4.0 / rank))
        self.buffer = buffer.to(dtype)


def delta_rows(
    pool: Pool, segments: list[tuple[int, int | None]], x: torch.Tensor, out: torch.Tensor, backend: str
) -> torch.Tensor:
    """``out`` plus the batch's deltas; ``segments``: (tokens, adapter index or None)."""
    seg = LoraSegments.build(
        [n for n, _ in segments],
        [None if a is None else pool.adapters[a][0] for _, a in segments],
        [1.0 if a is None else pool.adapters[a][1] for _, a in segments],
        IN_F,
        OUT_F,
        "cpu",
    )
    result = out.clone()
    add_lora_delta(x, pool.buffer, seg, result, backend, batch_invariant=True)
    return result


def batches(target_adapter: int) -> list[tuple[list[tuple[int, int | None]], int]]:
    """Batches holding the target token, and its row in each: decode groups of 1..5 tokens of its
    adapter among many one-token segments, prefill segments of 3..70 tokens, other adapters."""
    other = (target_adapter + 1) % len(RANKS)
    layouts: list[tuple[list[tuple[int, int | None]], int]] = [
        ([(1, target_adapter)], 0),
        ([(1, other), (1, target_adapter)], 1),
        ([(1, target_adapter)] * 2 + [(1, other)] * 6, 1),
        ([(1, target_adapter)] * 5 + [(1, None), (1, 2)] * 4, 3),
        ([(1, a % 3) for a in range(12)] + [(1, target_adapter)], 12),
        ([(17, target_adapter)], 9),
        ([(3, other), (70, target_adapter), (1, None)], 3 + 64),
        ([(5, 2), (1, target_adapter), (40, target_adapter)], 5),
    ]
    return layouts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["cpu_native", "triton"])
def test_a_tokens_delta_does_not_depend_on_its_batch(backend, dtype):
    if backend == "cpu_native" and not native_available():
        pytest.skip("the native CPU LoRA kernel did not build here")
    pool = Pool(dtype)
    g = torch.Generator().manual_seed(1)
    x_row, out_row = torch.randn(IN_F, generator=g).to(dtype), torch.randn(OUT_F, generator=g).to(dtype)
    for target in range(len(RANKS)):
        alone = None
        for segments, row in batches(target):
            tokens = sum(n for n, _ in segments)
            x = torch.randn(tokens, IN_F, generator=g).to(dtype)
            out = torch.randn(tokens, OUT_F, generator=g).to(dtype)
            x[row], out[row] = x_row, out_row
            got = delta_rows(pool, segments, x, out, backend)[row]
            assert not got.isnan().any()
            alone = got if alone is None else alone
            assert torch.equal(got, alone), f"adapter {target}: {segments} row {row}"
        assert not torch.equal(alone, out_row), "the adapter must change the row"


def test_backends_that_cannot_be_batch_invariant_refuse_it():
    pool = torch.zeros(8)
    for backend in ("torch", "padded_bmm"):
        with pytest.raises(ValueError, match="not batch-invariant"):
            resolve_backend(backend, pool, batch_invariant=True)
    assert resolve_backend("torch", pool) == "torch"
