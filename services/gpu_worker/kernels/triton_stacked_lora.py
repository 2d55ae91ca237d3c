"""Stacked MBGMV and MBGMM: the LoRA deltas of the projections that read one input in two launches.

A layer's q, k and v (and its gate and up) all read the same activations, so their deltas need
not be three shrink + expand pairs (six launches): one shrink launch computes
``h_p[t, :r] = x[t] @ A_{p,s}^T`` for every projection ``p``, every token row and its adapter slot
``s``, and one expand launch adds ``scale_{p,s} * h_p[t, :r] @ B_{p,s}^T`` into each projection's
output. A layer with all seven modules targeted goes from 14 launches to 8 (q/k/v 2, o 2,
gate/up 2, down 2): shrink before expand, and o and down read what the layer computed in between,
so that is as few as the dependencies allow while the shrink's reduction over the input features
stays a launch of its own. Decode (and batch-invariant) calls use the MBGMV form, prefill and
mixed calls the MBGMM form (``tl.dot`` tiles).

Each projection keeps its own segment tables (rank starts, A/Bᵀ offsets, scales: the persistent
device buffers of ``executor/lora_tables.py`` are read where they are, never copied), so adapters
of different ranks, and adapters that target q but not k, share one launch; ranks are per slot,
not padded. Programs pick their projection from the grid's last axis (the second for MBGMV, the
third for MBGMM): shrink programs ``p * rank_blocks + block``, expand programs the output blocks
of q, then k, then v.

Per program the arithmetic is :mod:`triton_lora`'s MBGMV or MBGMM, in the same order; with
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
    MBGMM_BLOCK_K,
    MBGMM_BLOCK_N,
    MBGMV_BLOCK_K,
    MBGMV_BLOCK_N,
    _add_scaled,
    _gmm_expand_block,
    _gmm_shrink_block,
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
def _projection_block(block, n_blocks_0, n_blocks_1):
    """A stacked expand program's projection and its output block in it: blocks of q, then k,
    then v."""
    p = (block >= n_blocks_0).to(tl.int32) + (block >= n_blocks_0 + n_blocks_1).to(tl.int32)
    return p, block - _pick_int(p, 0, n_blocks_0, n_blocks_0 + n_blocks_1)


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
    p, block = _projection_block(tl.program_id(1), n_blocks_0, n_blocks_1)
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


@triton.jit
def _stacked_gmm_shrink(
    x_ptr,
    pool_ptr,
    h_ptr,
    seg_starts_ptr,
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
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (segment, token block, projection x rank block): ``h[p, t, r] = x[t] . A_p[r]``."""
    p = tl.program_id(2) // rank_blocks
    rank_starts_ptr = _pick(p, rank_starts_0, rank_starts_1, rank_starts_2)
    a_offsets_ptr = _pick(p, a_offsets_0, a_offsets_1, a_offsets_2)
    seg_start, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, tl.program_id(0))
    t0 = seg_start + tl.program_id(1) * BLOCK_T
    r0 = (tl.program_id(2) % rank_blocks) * BLOCK_R
    if (t0 >= seg_end) | (r0 >= rank):
        return
    a_rows = a_offsets_ptr + rank_start
    h_p = h_ptr + p * stride_hp
    _gmm_shrink_block(
        x_ptr, pool_ptr, a_rows, h_p, t0, seg_end, r0, rank, in_features, stride_x, stride_h,
        BLOCK_T, BLOCK_R, BLOCK_K, DOT_FP32,
    )  # fmt: skip


@triton.jit
def _stacked_gmm_expand(
    h_ptr,
    pool_ptr,
    seg_starts_ptr,
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
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (segment, token block, output block of q then k then v):
    ``out_p[t, n] += scale_p * h[p, t, :r] . B_p^T[:r, n]``."""
    s = tl.program_id(0)
    p, block = _projection_block(tl.program_id(2), n_blocks_0, n_blocks_1)
    rank_starts_ptr = _pick(p, rank_starts_0, rank_starts_1, rank_starts_2)
    seg_start, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    t0 = seg_start + tl.program_id(1) * BLOCK_T
    if (t0 >= seg_end) | (rank == 0):
        return
    b_rows = _pick(p, b_offsets_0, b_offsets_1, b_offsets_2) + rank_start
    out_ptr = _pick(p, out_0, out_1, out_2)
    scale = tl.load(_pick(p, scales_0, scales_1, scales_2) + s)
    out_features = _pick_int(p, out_features_0, out_features_1, out_features_2)
    stride_out = _pick_int(p, stride_out_0, stride_out_1, stride_out_2)
    _gmm_expand_block(
        h_ptr + p * stride_hp, pool_ptr, b_rows, out_ptr, scale, t0, seg_end, rank, block,
        out_features, stride_h, stride_out, BLOCK_T, BLOCK_R, BLOCK_N, DOT_FP32,
    )  # fmt: skip


def stackable(segments: Sequence[LoraSegments]) -> bool:
    """Whether the stacked kernels serve these segments in one launch pair: 2 or 3 projections
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
    x, h, first = _prepare("stacked_mbgmv", x, pool, segments, outs)
    if first.max_seg_len > 1 and not batch_invariant:
        raise ValueError(
            f"stacked_mbgmv: segments must have one token each, the longest has {first.max_seg_len}"
        )
    if h is None:
        return
    block_r = INVARIANT_BLOCK_R if batch_invariant else triton_lora._block(h.shape[2])
    programs = first.num_tokens if batch_invariant else first.num_segments
    token_segs = triton_lora._token_segments(first) if batch_invariant else first.seg_starts
    tables = _Tables(segments, outs, MBGMV_BLOCK_N)
    rank_blocks = triton.cdiv(h.shape[2], block_r)
    _stacked_shrink[(programs, len(segments) * rank_blocks)](
        x,
        pool,
        h,
        first.seg_starts,
        token_segs,
        *tables.shrink(),
        first.in_features,
        x.stride(0),
        h.stride(1),
        h.stride(0),
        rank_blocks,
        BLOCK_R=block_r,
        BLOCK_K=MBGMV_BLOCK_K,
        PER_TOKEN=batch_invariant,
    )
    _stacked_expand[(programs, tables.out_blocks)](
        h,
        pool,
        first.seg_starts,
        token_segs,
        *tables.expand(),
        h.stride(1),
        h.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=MBGMV_BLOCK_N,
        PER_TOKEN=batch_invariant,
    )


def stacked_mbgmm(
    x: torch.Tensor, pool: torch.Tensor, segments: Sequence[LoraSegments], outs: Sequence[torch.Tensor]
) -> None:
    """Add the prefill LoRA delta (any segment lengths) of ``segments[i]`` into ``outs[i]`` for
    2-3 projections that read ``x``, in one shrink and one expand launch; each term as
    :func:`~triton_lora.mbgmm` computes it."""
    x, h, first = _prepare("stacked_mbgmm", x, pool, segments, outs)
    if h is None:
        return
    block_r = triton_lora._block(h.shape[2])
    block_t = triton_lora._block(first.max_seg_len)
    t_blocks = triton.cdiv(first.max_seg_len, block_t)
    dot_fp32 = triton_lora.dot_in_fp32(pool)
    tables = _Tables(segments, outs, MBGMM_BLOCK_N)
    rank_blocks = triton.cdiv(h.shape[2], block_r)
    _stacked_gmm_shrink[(first.num_segments, t_blocks, len(segments) * rank_blocks)](
        x,
        pool,
        h,
        first.seg_starts,
        *tables.shrink(),
        first.in_features,
        x.stride(0),
        h.stride(1),
        h.stride(0),
        rank_blocks,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=MBGMM_BLOCK_K,
        DOT_FP32=dot_fp32,
    )
    _stacked_gmm_expand[(first.num_segments, t_blocks, tables.out_blocks)](
        h,
        pool,
        first.seg_starts,
        *tables.expand(),
        h.stride(1),
        h.stride(0),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_N=MBGMM_BLOCK_N,
        DOT_FP32=dot_fp32,
    )


def _prepare(
    name: str,
    x: torch.Tensor,
    pool: torch.Tensor,
    segments: Sequence[LoraSegments],
    outs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None, LoraSegments]:
    """Check a stacked call; -> ``x`` with unit column stride, the fp32 ``h`` scratch
    ``[projections, T, max rank]`` (None: nothing to add) and the first projection's segments."""
    if not stackable(segments) or len(outs) != len(segments):
        raise ValueError(
            f"{name}: {len(segments)} projections / {len(outs)} outputs; expected 2 to "
            f"{MAX_STACKED} projections over the same tokens and input width"
        )
    for seg, out in zip(segments, outs, strict=True):
        x = triton_lora._check(x, pool, seg, out)
    first = segments[0]
    max_rank = max(seg.max_rank for seg in segments)
    if max_rank == 0 or first.max_seg_len == 0:
        return x, None, first
    h = torch.empty((len(segments), x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    return x, h, first


class _Tables:
    """The per-projection arguments of the stacked kernels, three of each: an absent third
    projection repeats the last one's, which no program picks."""

    def __init__(self, segments: Sequence[LoraSegments], outs: Sequence[torch.Tensor], block_n: int):
        self.segments = list(segments) + [segments[-1]] * (MAX_STACKED - len(segments))
        self.outs = list(outs) + [outs[-1]] * (MAX_STACKED - len(outs))
        self.n_blocks = [triton.cdiv(seg.out_features, block_n) for seg in self.segments]
        self.out_blocks = sum(self.n_blocks[: len(segments)])
        """The expand grid's blocks: every projection's output blocks, one after another."""

    def shrink(self) -> tuple:
        """Rank starts, then A offsets."""
        return (*(seg.rank_starts for seg in self.segments), *(seg.a_offsets for seg in self.segments))

    def expand(self) -> tuple:
        """Outputs, rank starts, Bᵀ offsets, scales, output widths and strides, and the first two
        projections' output block counts."""
        segs = self.segments
        return (
            *self.outs,
            *(seg.rank_starts for seg in segs),
            *(seg.b_offsets for seg in segs),
            *(seg.scales for seg in segs),
            *(seg.out_features for seg in segs),
            *(out.stride(0) for out in self.outs),
            self.n_blocks[0],
            self.n_blocks[1],
        )
