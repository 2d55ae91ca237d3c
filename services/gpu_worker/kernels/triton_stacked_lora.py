"""Stacked MBGMV: the LoRA deltas of the projections that read one input in two launches.

A decode layer's q, k and v (and its gate and up) all read the same activations, so their deltas
need not be three shrink + expand pairs (six launches): one shrink launch computes
``h_p[t, :r] = x[t] @ A_{p,s}^T`` for every projection ``p``, every token row and its adapter slot
``s``, and one expand launch adds ``scale_{p,s} * h_p[t, :r] @ B_{p,s}^T`` into each projection's
output. A layer with all seven modules targeted goes from 14 launches to 8 (q/k/v 2, o 2,
gate/up 2, down 2): shrink before expand, and o and down read what the layer computed in between,
so that is as few as the dependencies allow while the shrink's reduction over the input features
stays a launch of its own.

Each projection keeps its own segment tables (rank starts, A/Bᵀ offsets, scales: the persistent
device buffers of ``executor/lora_tables.py`` are read where they are, never copied), so adapters
of different ranks, and adapters that target q but not k, share one launch; ranks are per slot,
not padded. Programs pick their projection from the grid's second axis: shrink programs
``p * rank_blocks + block``, expand programs the output blocks of q, then k, then v.

Per program the arithmetic is :mod:`triton_lora`'s MBGMV, in the same order; with
``batch_invariant`` (one program per token, :data:`~triton_lora.INVARIANT_BLOCK_R` rank blocks)
a token's delta is the same bits as unstacked MBGMV's and independent of the rest of the batch.

Like :mod:`triton_lora`, importing this defines the kernels: ``TRITON_INTERPRET=1`` must be set
before the first import for them to run on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import triton_lora
from services.gpu_worker.kernels.lora_segments import LoraSegments, share_input
from services.gpu_worker.kernels.triton_lora import (
    INVARIANT_BLOCK_R,
    MBGMV_BLOCK_K,
    MBGMV_BLOCK_N,
    _add_scaled,
    _gmv_expand_row,
    _gmv_shrink_block,
    _mbgmv_token,
    _segment,
)

MAX_STACKED = 3
"""Most projections one stacked launch serves (q, k and v)."""


@triton.jit
def _pick(p, first, second, third):
    """Projection ``p``'s pointer among three (branches, not ``tl.where``: these are pointers)."""
    if p == 0:
        chosen = first
    elif p == 1:
        chosen = second
    else:
        chosen = third
    return chosen


@triton.jit
def _pick_int(p, first, second, third):
    """Projection ``p``'s integer among three (any of them may be specialized to a constant)."""
    return tl.where(p == 0, first, tl.where(p == 1, second, third))


@triton.jit
def _stacked_shrink(
    x_ptr,
    pool_ptr,
    h_ptr,
    seg_starts_ptr,
    token_segs_ptr,
    rank_starts_0,
    rank_starts_1,
    rank_starts_2,
    a_offsets_0,
    a_offsets_1,
    a_offsets_2,
    in_features,
    stride_x,
    stride_h,
    stride_hp,
    rank_blocks,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Program (segment or token, projection x rank block): ``h[p, tok, r] = x[tok] . A_p[r]``."""
    s, token = _mbgmv_token(seg_starts_ptr, token_segs_ptr, PER_TOKEN)
    p = tl.program_id(1) // rank_blocks
    rank_starts_ptr = _pick(p, rank_starts_0, rank_starts_1, rank_starts_2)
    a_offsets_ptr = _pick(p, a_offsets_0, a_offsets_1, a_offsets_2)
    _, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    r0 = (tl.program_id(1) % rank_blocks) * BLOCK_R
    if (token == seg_end) | (r0 >= rank):
        return
    h_row = h_ptr + p * stride_hp + token * stride_h
    x_row = x_ptr + token * stride_x
    _gmv_shrink_block(
        x_row, pool_ptr, a_offsets_ptr + rank_start, h_row, r0, rank, in_features, BLOCK_R, BLOCK_K
    )


@triton.jit
def _stacked_expand(
    h_ptr,
    pool_ptr,
    seg_starts_ptr,
    token_segs_ptr,
    out_0,
    out_1,
    out_2,
    rank_starts_0,
    rank_starts_1,
    rank_starts_2,
    b_offsets_0,
    b_offsets_1,
    b_offsets_2,
    scales_0,
    scales_1,
    scales_2,
    out_features_0,
    out_features_1,
    out_features_2,
    stride_out_0,
    stride_out_1,
    stride_out_2,
    n_blocks_0,
    n_blocks_1,
    stride_h,
    stride_hp,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Program (segment or token, output block of q then k then v):
    ``out_p[tok, n] += scale_p * h[p, tok, :r] . B_p^T[:r, n]``."""
    s, token = _mbgmv_token(seg_starts_ptr, token_segs_ptr, PER_TOKEN)
    block = tl.program_id(1)
    p = (block >= n_blocks_0).to(tl.int32) + (block >= n_blocks_0 + n_blocks_1).to(tl.int32)
    block -= _pick_int(p, 0, n_blocks_0, n_blocks_0 + n_blocks_1)
    rank_starts_ptr = _pick(p, rank_starts_0, rank_starts_1, rank_starts_2)
    _, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    if (token == seg_end) | (rank == 0):
        return
    b_offsets_ptr = _pick(p, b_offsets_0, b_offsets_1, b_offsets_2)
    out_ptr = _pick(p, out_0, out_1, out_2)
    scales_ptr = _pick(p, scales_0, scales_1, scales_2)
    out_features = _pick_int(p, out_features_0, out_features_1, out_features_2)
    stride_out = _pick_int(p, stride_out_0, stride_out_1, stride_out_2)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    h_row = h_ptr + p * stride_hp + token * stride_h
    acc = _gmv_expand_row(h_row, pool_ptr, b_offsets_ptr + rank_start, rank, n, n_mask, BLOCK_R, BLOCK_N)
    _add_scaled(out_ptr + token * stride_out + n, n_mask, acc, tl.load(scales_ptr + s))


def stackable(segments: Sequence[LoraSegments]) -> bool:
    """Whether :func:`stacked_mbgmv` serves these segments in one launch pair: 2 or 3 projections
    over the same token segments and the same input width."""
    return 2 <= len(segments) <= MAX_STACKED and share_input(segments)


def stacked_mbgmv(
    x: torch.Tensor,
    pool: torch.Tensor,
    segments: Sequence[LoraSegments],
    outs: Sequence[torch.Tensor],
    batch_invariant: bool = False,
) -> None:
    """Add the decode LoRA delta of ``segments[i]`` into ``outs[i]`` for 2-3 projections that read
    ``x``, in one shrink and one expand launch; each term as :func:`~triton_lora.mbgmv` computes
    it (``batch_invariant``: segments of any length, one program per token)."""
    if not stackable(segments) or len(outs) != len(segments):
        raise ValueError(
            f"stacked_mbgmv: {len(segments)} projections / {len(outs)} outputs; expected 2 to "
            f"{MAX_STACKED} projections over the same tokens and input width"
        )
    for seg, out in zip(segments, outs, strict=True):
        x = triton_lora._check(x, pool, seg, out)
    first = segments[0]
    if first.max_seg_len > 1 and not batch_invariant:
        raise ValueError(
            f"stacked_mbgmv: segments must have one token each, the longest has {first.max_seg_len}"
        )
    max_rank = max(seg.max_rank for seg in segments)
    if max_rank == 0 or first.max_seg_len == 0:
        return
    h = torch.empty((len(segments), x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    block_r = INVARIANT_BLOCK_R if batch_invariant else triton_lora._block(max_rank)
    programs = first.num_tokens if batch_invariant else first.num_segments
    token_segs = triton_lora._token_segments(first) if batch_invariant else first.seg_starts
    # Absent third projection: its slots repeat the last one's, which no program picks.
    padded = list(segments) + [segments[-1]] * (MAX_STACKED - len(segments))
    padded_outs = list(outs) + [outs[-1]] * (MAX_STACKED - len(outs))
    rank_blocks = triton.cdiv(max_rank, block_r)
    _stacked_shrink[(programs, len(segments) * rank_blocks)](
        x,
        pool,
        h,
        first.seg_starts,
        token_segs,
        *(seg.rank_starts for seg in padded),
        *(seg.a_offsets for seg in padded),
        first.in_features,
        x.stride(0),
        h.stride(1),
        h.stride(0),
        rank_blocks,
        BLOCK_R=block_r,
        BLOCK_K=MBGMV_BLOCK_K,
        PER_TOKEN=batch_invariant,
    )
    n_blocks = [triton.cdiv(seg.out_features, MBGMV_BLOCK_N) for seg in padded]
    _stacked_expand[(programs, sum(n_blocks[: len(segments)]))](
        h,
        pool,
        first.seg_starts,
        token_segs,
        *padded_outs,
        *(seg.rank_starts for seg in padded),
        *(seg.b_offsets for seg in padded),
        *(seg.scales for seg in padded),
        *(seg.out_features for seg in padded),
        *(out.stride(0) for out in padded_outs),
        n_blocks[0],
        n_blocks[1],
        h.stride(1),
        h.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=MBGMV_BLOCK_N,
        PER_TOKEN=batch_invariant,
    )
