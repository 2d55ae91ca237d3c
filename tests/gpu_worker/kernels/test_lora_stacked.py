"""Stacked MBGMV and MBGMM (q/k/v or gate/up in one shrink and one expand launch) against the
torch reference, in the Triton CPU interpreter, fp32: mixed adapters and mixed ranks in one batch, an
adapter that targets q but not k, base-only rows, and the persistent on-device tables whose rank
width is padded past every adapter's rank.

``TRITON_INTERPRET`` is set before anything imports the Triton kernels; shapes are small for the
interpreter's sake.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from services.gpu_worker.kernels import triton_lora, triton_stacked_lora
from services.gpu_worker.kernels.dispatch import StepLora
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.gpu_worker.kernels.torch_reference import stacked_lora_delta_torch

IN_FEATURES = 40
"""Width of x: not a multiple of the 128-wide K blocks."""
QKV_OUT = (48, 24, 24)
RANKS = (4, 20, 8, 1)
"""Ranks of adapters 0-3; 20 spans two 16-wide batch-invariant rank blocks."""
DECODE_ADAPTERS = (0, 1, None, 2, 0, 3, 1)
"""Adapter of each decode row (None: base model only)."""
NOT_TARGETED = {1: 1}
"""Adapter 1 does not target projection 1 (k)."""


def _pool_and_rows(generator: torch.Generator) -> tuple[torch.Tensor, dict[tuple[int, int], AdapterRows]]:
    """A NaN pool (a stray read shows) with every (adapter, projection)'s rows at shuffled slots."""
    slot = max(IN_FEATURES, *QKV_OUT)
    wanted = [(a, p) for a in range(len(RANKS)) for p in range(len(QKV_OUT)) if NOT_TARGETED.get(a) != p]
    slots = torch.randperm(2 * sum(2 * RANKS[a] for a, _ in wanted), generator=generator).tolist()
    pool = torch.full((len(slots) * slot,), float("nan"))
    rows = {}
    for a, p in wanted:
        offsets = []
        for width in (IN_FEATURES, QKV_OUT[p]):
            picked = [slots.pop() * slot for _ in range(RANKS[a])]
            for offset in picked:
                pool[offset : offset + width] = torch.randn(width, generator=generator) * 0.3
            offsets.append(torch.tensor(picked, dtype=torch.int64))
        rows[(a, p)] = AdapterRows(*offsets)
    return pool, rows


def _segments(counts: tuple[int, ...], rows: dict) -> list[LoraSegments]:
    scales = [0.5 + 0.25 * (a or 0) for a in DECODE_ADAPTERS]
    return [
        LoraSegments.build(
            list(counts),
            [rows.get((a, p)) if a is not None else None for a in DECODE_ADAPTERS],
            scales,
            IN_FEATURES,
            out,
            "cpu",
        )
        for p, out in enumerate(QKV_OUT)
    ]


def _case(counts: tuple[int, ...], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool, rows = _pool_and_rows(g)
    segments = _segments(counts, rows)
    tokens = sum(counts)
    x = torch.randn(tokens, IN_FEATURES, generator=g)
    outs = [torch.randn(tokens, out, generator=g) for out in QKV_OUT]
    return pool, segments, x, outs


def _reference(pool, segments, x, outs) -> list[torch.Tensor]:
    expected = [out.clone() for out in outs]
    stacked_lora_delta_torch(x, pool, segments, expected)
    return expected


@pytest.mark.parametrize("projections", [3, 2])
def test_stacked_decode_matches_reference(projections: int) -> None:
    pool, segments, x, outs = _case((1,) * len(DECODE_ADAPTERS))
    segments, outs = segments[:projections], outs[:projections]
    expected = _reference(pool, segments, x, outs)
    got = [out.clone() for out in outs]
    triton_stacked_lora.stacked_mbgmv(x, pool, segments, got)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    base_row = DECODE_ADAPTERS.index(None)
    for g, out in zip(got, outs, strict=True):
        assert torch.equal(g[base_row], out[base_row])


@pytest.mark.parametrize("projections", [3, 2])
def test_stacked_prefill_matches_reference(projections: int) -> None:
    """Prefill segments of several lengths (one longer than a 16-token block) through MBGMM."""
    pool, segments, x, outs = _case((3, 1, 5, 18, 2, 1, 4), seed=3)
    segments, outs = segments[:projections], outs[:projections]
    got = [out.clone() for out in outs]
    triton_stacked_lora.stacked_mbgmm(x, pool, segments, got)
    for g, e in zip(got, _reference(pool, segments, x, outs), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    base_rows = slice(4, 9)  # segment 2, no adapter
    for g, out in zip(got, outs, strict=True):
        assert torch.equal(g[base_rows], out[base_rows])


def test_batch_invariant_is_unstacked_mbgmv_bit_for_bit() -> None:
    """Per token, the stacked kernels do MBGMV's arithmetic in MBGMV's order: the same bits."""
    pool, segments, x, outs = _case((2, 1, 3, 1, 1, 2, 1), seed=1)
    stacked = [out.clone() for out in outs]
    triton_stacked_lora.stacked_mbgmv(x, pool, segments, stacked, batch_invariant=True)
    for seg, out, got in zip(segments, outs, stacked, strict=True):
        alone = out.clone()
        triton_lora.mbgmv(x, pool, seg, alone, batch_invariant=True)
        assert torch.equal(got, alone)
    for got, expected in zip(stacked, _reference(pool, segments, x, outs), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_step_lora_stacks_persistent_padded_tables() -> None:
    """The model's call on device-built tables (rank width padded to 32, no host rank starts)
    goes through the stacked kernels and adds what the reference adds."""
    pool, segments, x, outs = _case((1,) * len(DECODE_ADAPTERS), seed=2)
    padded = [
        LoraSegments.on_device(
            seg.seg_starts,
            seg.seg_starts_host,
            seg.rank_starts,
            seg.a_offsets,
            seg.b_offsets,
            seg.scales,
            32,
            seg.in_features,
            seg.out_features,
        )
        for seg in segments
    ]
    names = ("q_proj", "k_proj", "v_proj")
    step = StepLora([dict(zip(names, padded, strict=True))])
    got = tuple(out.clone() for out in outs)
    step.add_deltas(0, names, x, got, pool, backend="triton")
    assert all(call.stacked for call in step._prepared.values())
    for g, e in zip(got, _reference(pool, segments, x, outs), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_step_lora_stacks_prefill() -> None:
    pool, segments, x, outs = _case((2, 3, 1, 1, 4, 1, 2), seed=4)
    names = ("gate_proj", "up_proj")
    step = StepLora([dict(zip(names, segments[:2], strict=True))])
    got = tuple(out.clone() for out in outs[:2])
    step.add_deltas(0, names, x, got, pool, backend="triton")
    assert all(call.stacked for call in step._prepared.values())
    for g, e in zip(got, _reference(pool, segments[:2], x, outs[:2]), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_refuses_projections_over_different_tokens() -> None:
    pool, segments, x, outs = _case((1,) * len(DECODE_ADAPTERS))
    other = LoraSegments.build([7], [None], [1.0], IN_FEATURES, QKV_OUT[1], "cpu")
    with pytest.raises(ValueError, match="same tokens"):
        triton_stacked_lora.stacked_mbgmv(x, pool, [segments[0], other], outs[:2])
