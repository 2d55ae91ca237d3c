"""MBGMM and MBGMV (S-LoRA §5.3): multi-rank LoRA gathered straight from the unified pool.

Both are a shrink + expand pair (Punica style): shrink ``h[t, :r_s] = x[t] @ A_s^T`` into an fp32
``[T, max_rank]`` scratch, expand ``out[t] += scale_s * h[t, :r_s] @ B_s^T``. Each program loads
its segment's row offsets and then the rows themselves with ``pool + offset[:, None] + k[None, :]``,
so adapters of different ranks share one launch and no weight is ever padded or copied; masks
cover ranks, tokens and features that do not fill a block.

MBGMM (prefill, many tokens per segment) tiles with ``tl.dot``; MBGMV (decode, one token per
segment) is memory bound and reduces with ``tl.sum`` in fp32.

Batch-invariant serving (``batch_invariant=True``) runs every batch, prefill included, through
MBGMV with one program per token and fixed rank blocks (:data:`INVARIANT_BLOCK_R`): a token's
sums then follow only its own row and adapter. MBGMM's tiles follow the batch (its longest segment
and largest rank), and a ``tl.dot`` row need not round alike at every place in its tile (the CPU
interpreter's OpenBLAS does not), so it cannot give that guarantee.

Importing this module defines the kernels: ``TRITON_INTERPRET=1`` must be set before the first
import for them to run on CPU tensors, so nothing imports it at package import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from services.gpu_worker.kernels.lora_segments import LoraSegments

INTERPRETED = bool(knobs.runtime.interpret)
"""Whether the kernels below were defined for the CPU interpreter (decided at import, like triton)."""

# Block sizes stay >= 16: tl.dot on GPUs needs it. Rank and token blocks adapt to the batch.
MBGMM_BLOCK_K = 64
MBGMM_BLOCK_N = 64
MBGMV_BLOCK_K = 128
MBGMV_BLOCK_N = 128
INVARIANT_BLOCK_R = 16
"""Rank block of batch-invariant MBGMV, whatever the batch's largest rank."""


@triton.jit
def _segment(seg_starts_ptr, rank_starts_ptr, s):
    """Segment ``s``'s tokens ``[seg_start, seg_end)``, its first row in the offset tables and its rank."""
    seg_start = tl.load(seg_starts_ptr + s)
    seg_end = tl.load(seg_starts_ptr + s + 1)
    rank_start = tl.load(rank_starts_ptr + s)
    rank = tl.load(rank_starts_ptr + s + 1) - rank_start
    return seg_start, seg_end, rank_start, rank


@triton.jit
def _mbgmv_token(seg_starts_ptr, token_segs_ptr, PER_TOKEN: tl.constexpr):
    """This MBGMV program's segment and token row: axis 0 numbers segments (each its first token),
    or with ``PER_TOKEN`` token rows (each in its segment)."""
    if PER_TOKEN:
        token = tl.program_id(0)
        s = tl.load(token_segs_ptr + token)
    else:
        s = tl.program_id(0)
        token = tl.load(seg_starts_ptr + s)
    return s, token


@triton.jit
def _dot_pool_tile(lhs, w, acc, DOT_FP32: tl.constexpr):
    """``acc + lhs @ w`` for a tile ``w`` of pool weights: exact fp32 dots (not tf32), or dots in the
    pool's dtype (tensor cores on GPUs) accumulated in fp32."""
    if DOT_FP32:
        acc = tl.dot(lhs.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(lhs.to(w.dtype), w, acc)
    return acc


@triton.jit
def _add_scaled(out_ptrs, mask, delta, scale):
    """``out += scale * delta``: summed in fp32, stored in ``out``'s dtype."""
    o = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (o.to(tl.float32) + delta * scale).to(o.dtype), mask=mask)


@triton.jit
def _gmv_shrink_block(
    x_row_ptr,
    pool_ptr,
    a_offsets_ptr,
    h_row_ptr,
    r0,
    rank,
    in_features,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``h_row[r] = x_row . A[r]`` for ranks ``r0 .. r0 + BLOCK_R`` below ``rank``, the A rows at the
    pool offsets ``a_offsets_ptr[r]``; fp32, summed block of K after block of K."""
    r = r0 + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    a_off = tl.load(a_offsets_ptr + r, mask=r_mask, other=0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xk = tl.load(x_row_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(pool_ptr + a_off[:, None] + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(h_row_ptr + r, acc, mask=r_mask)


@triton.jit
def _gmv_expand_row(
    h_row_ptr, pool_ptr, b_offsets_ptr, rank, n, n_mask, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr
):
    """fp32 ``[BLOCK_N]``: one token's ``h[:rank]`` times the Bᵀ rows whose pool offsets
    ``b_offsets_ptr[:rank]`` holds, at output columns ``n``, summed rank block after rank block."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        b_off = tl.load(b_offsets_ptr + r, mask=r_mask, other=0)
        hr = tl.load(h_row_ptr + r, mask=r_mask, other=0.0)
        b = tl.load(pool_ptr + b_off[:, None] + n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(hr[:, None] * b.to(tl.float32), axis=0)
    return acc


@triton.jit
def _gmm_shrink_block(
    x_ptr,
    pool_ptr,
    a_offsets_ptr,
    h_ptr,
    t0,
    seg_end,
    r0,
    rank,
    in_features,
    stride_x,
    stride_h,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``h[t, r] = x[t] . A[r]`` for the tokens ``t0 .. t0 + BLOCK_T`` below ``seg_end`` and ranks
    ``r0 .. r0 + BLOCK_R`` below ``rank``, the A rows at the pool offsets ``a_offsets_ptr[r]``."""
    t = t0 + tl.arange(0, BLOCK_T)
    r = r0 + tl.arange(0, BLOCK_R)
    t_mask = t < seg_end
    r_mask = r < rank
    a_off = tl.load(a_offsets_ptr + r, mask=r_mask, other=0)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xt = tl.load(
            x_ptr + t[:, None] * stride_x + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
        )
        # A^T tile [K, R]: column r is A row r, wherever it lives in the pool.
        at = tl.load(
            pool_ptr + a_off[None, :] + k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0
        )
        acc = _dot_pool_tile(xt, at, acc, DOT_FP32)
    tl.store(h_ptr + t[:, None] * stride_h + r[None, :], acc, mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _gmm_expand_block(
    h_ptr,
    pool_ptr,
    b_offsets_ptr,
    out_ptr,
    scale,
    t0,
    seg_end,
    rank,
    n_block,
    out_features,
    stride_h,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``out[t, n] += scale * h[t, :rank] . B^T[:rank, n]`` for the tokens ``t0 .. t0 + BLOCK_T``
    below ``seg_end`` and output block ``n_block``, the Bᵀ rows at ``b_offsets_ptr[r]``."""
    t = t0 + tl.arange(0, BLOCK_T)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = t < seg_end
    n_mask = n < out_features
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        b_off = tl.load(b_offsets_ptr + r, mask=r_mask, other=0)
        ht = tl.load(
            h_ptr + t[:, None] * stride_h + r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0
        )
        bt = tl.load(
            pool_ptr + b_off[:, None] + n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )
        acc = _dot_pool_tile(ht, bt, acc, DOT_FP32)
    o_ptrs = out_ptr + t[:, None] * stride_out + n[None, :]
    _add_scaled(o_ptrs, t_mask[:, None] & n_mask[None, :], acc, scale)


@triton.jit
def _mbgmm_shrink(
    x_ptr,
    pool_ptr,
    h_ptr,
    seg_starts_ptr,
    rank_starts_ptr,
    a_offsets_ptr,
    in_features,
    stride_x,
    stride_h,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (segment, token block, rank block): ``h[t, r] = x[t] . A[r]``."""
    seg_start, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, tl.program_id(0))
    t0 = seg_start + tl.program_id(1) * BLOCK_T
    r0 = tl.program_id(2) * BLOCK_R
    if (t0 >= seg_end) | (r0 >= rank):
        return
    _gmm_shrink_block(
        x_ptr,
        pool_ptr,
        a_offsets_ptr + rank_start,
        h_ptr,
        t0,
        seg_end,
        r0,
        rank,
        in_features,
        stride_x,
        stride_h,
        BLOCK_T,
        BLOCK_R,
        BLOCK_K,
        DOT_FP32,
    )


@triton.jit
def _mbgmm_expand(
    h_ptr,
    pool_ptr,
    out_ptr,
    seg_starts_ptr,
    rank_starts_ptr,
    b_offsets_ptr,
    scales_ptr,
    out_features,
    stride_h,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (segment, token block, output block): ``out[t, n] += scale * h[t, :r] . B^T[:r, n]``."""
    s = tl.program_id(0)
    seg_start, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    t0 = seg_start + tl.program_id(1) * BLOCK_T
    if (t0 >= seg_end) | (rank == 0):
        return
    _gmm_expand_block(
        h_ptr,
        pool_ptr,
        b_offsets_ptr + rank_start,
        out_ptr,
        tl.load(scales_ptr + s),
        t0,
        seg_end,
        rank,
        tl.program_id(2),
        out_features,
        stride_h,
        stride_out,
        BLOCK_T,
        BLOCK_R,
        BLOCK_N,
        DOT_FP32,
    )


@triton.jit
def _mbgmv_shrink(
    x_ptr,
    pool_ptr,
    h_ptr,
    seg_starts_ptr,
    rank_starts_ptr,
    a_offsets_ptr,
    in_features,
    stride_x,
    stride_h,
    token_segs_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Program (segment, rank block): ``h[tok, r] = x[tok] . A[r]`` for the segment's one token;
    with ``PER_TOKEN``, program (token, rank block) over segments of any length."""
    s, token = _mbgmv_token(seg_starts_ptr, token_segs_ptr, PER_TOKEN)
    _, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    r0 = tl.program_id(1) * BLOCK_R
    if (token == seg_end) | (r0 >= rank):
        return
    _gmv_shrink_block(
        x_ptr + token * stride_x,
        pool_ptr,
        a_offsets_ptr + rank_start,
        h_ptr + token * stride_h,
        r0,
        rank,
        in_features,
        BLOCK_R,
        BLOCK_K,
    )


@triton.jit
def _mbgmv_expand(
    h_ptr,
    pool_ptr,
    out_ptr,
    seg_starts_ptr,
    rank_starts_ptr,
    b_offsets_ptr,
    scales_ptr,
    out_features,
    stride_h,
    stride_out,
    token_segs_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Program (segment, output block): ``out[tok, n] += scale * h[tok, :r] . B^T[:r, n]``; with
    ``PER_TOKEN``, program (token, output block)."""
    s, token = _mbgmv_token(seg_starts_ptr, token_segs_ptr, PER_TOKEN)
    _, seg_end, rank_start, rank = _segment(seg_starts_ptr, rank_starts_ptr, s)
    if (token == seg_end) | (rank == 0):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    acc = _gmv_expand_row(
        h_ptr + token * stride_h, pool_ptr, b_offsets_ptr + rank_start, rank, n, n_mask, BLOCK_R, BLOCK_N
    )
    _add_scaled(out_ptr + token * stride_out + n, n_mask, acc, tl.load(scales_ptr + s))


def mbgmm(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> None:
    """Prefill LoRA delta (any segment lengths), added into ``out`` in place; same contract as
    :func:`~services.gpu_worker.kernels.torch_reference.lora_delta_torch`."""
    x = _check(x, pool, seg, out)
    if seg.max_rank == 0 or seg.max_seg_len == 0:
        return
    h = torch.empty((x.shape[0], seg.max_rank), dtype=torch.float32, device=x.device)
    block_r = _block(seg.max_rank)
    block_t = _block(seg.max_seg_len)
    dot_fp32 = dot_in_fp32(pool)
    t_blocks = triton.cdiv(seg.max_seg_len, block_t)
    _mbgmm_shrink[(seg.num_segments, t_blocks, triton.cdiv(seg.max_rank, block_r))](
        *_shrink_args(x, pool, h, seg),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=MBGMM_BLOCK_K,
        DOT_FP32=dot_fp32,
    )
    _mbgmm_expand[(seg.num_segments, t_blocks, triton.cdiv(seg.out_features, MBGMM_BLOCK_N))](
        *_expand_args(h, pool, out, seg),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_N=MBGMM_BLOCK_N,
        DOT_FP32=dot_fp32,
    )


def mbgmv(
    x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor, batch_invariant: bool = False
) -> None:
    """Decode LoRA delta (every segment one token), added into ``out`` in place; same contract as
    :func:`~services.gpu_worker.kernels.torch_reference.lora_delta_torch`. ``batch_invariant``:
    segments of any length, one program per token, fixed rank blocks: a token's delta does not
    depend on the rest of the batch."""
    x = _check(x, pool, seg, out)
    if seg.max_seg_len > 1 and not batch_invariant:
        raise ValueError(f"mbgmv: segments must have one token each, the longest has {seg.max_seg_len}")
    if seg.max_rank == 0 or seg.max_seg_len == 0:
        return
    h = torch.empty((x.shape[0], seg.max_rank), dtype=torch.float32, device=x.device)
    block_r = INVARIANT_BLOCK_R if batch_invariant else _block(seg.max_rank)
    programs = seg.num_tokens if batch_invariant else seg.num_segments
    token_segs = _token_segments(seg) if batch_invariant else seg.seg_starts
    _mbgmv_shrink[(programs, triton.cdiv(seg.max_rank, block_r))](
        *_shrink_args(x, pool, h, seg),
        token_segs,
        BLOCK_R=block_r,
        BLOCK_K=MBGMV_BLOCK_K,
        PER_TOKEN=batch_invariant,
    )
    _mbgmv_expand[(programs, triton.cdiv(seg.out_features, MBGMV_BLOCK_N))](
        *_expand_args(h, pool, out, seg),
        token_segs,
        BLOCK_R=block_r,
        BLOCK_N=MBGMV_BLOCK_N,
        PER_TOKEN=batch_invariant,
    )


def dot_in_fp32(pool: torch.Tensor) -> bool:
    """MBGMM's ``DOT_FP32``: fp32 dots when the pool is fp32 (exact, not tf32) and always in the
    interpreter, which gets bf16 ``tl.dot`` wrong; on GPUs half pools use tensor cores with fp32
    accumulation."""
    return INTERPRETED or pool.dtype == torch.float32


def _shrink_args(x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, seg: LoraSegments) -> tuple:
    """The arguments MBGMM's and MBGMV's shrink kernels share, in their order: x, the pool, the h
    scratch, the segment and A-row tables, and the sizes and strides they index by."""
    return (
        x,
        pool,
        h,
        seg.seg_starts,
        seg.rank_starts,
        seg.a_offsets,
        seg.in_features,
        x.stride(0),
        h.stride(0),
    )


def _expand_args(h: torch.Tensor, pool: torch.Tensor, out: torch.Tensor, seg: LoraSegments) -> tuple:
    """The arguments MBGMM's and MBGMV's expand kernels share, in their order: h, the pool, out,
    the segment, B-row and scale tables, and the sizes and strides they index by."""
    return (
        h,
        pool,
        out,
        seg.seg_starts,
        seg.rank_starts,
        seg.b_offsets,
        seg.scales,
        seg.out_features,
        h.stride(0),
        out.stride(0),
    )


def _token_segments(seg: LoraSegments) -> torch.Tensor:
    """int32 [T]: the segment of each token row (computed once per batch)."""
    cached = seg.derived.get("token_segments")
    if cached is None:
        starts = seg.seg_starts.long()
        segments = torch.arange(seg.num_segments, dtype=torch.int32, device=starts.device)
        cached = seg.derived["token_segments"] = torch.repeat_interleave(segments, starts[1:] - starts[:-1])
    return cached


def _block(n: int) -> int:
    """A power-of-two block covering ``n`` (up to 64), at least 16."""
    return min(64, max(16, triton.next_power_of_2(n)))


def _check(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> torch.Tensor:
    """Validate shapes and layouts the kernels index by hand; returns ``x`` with unit column stride."""
    if pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous 1-D tensor, got shape {tuple(pool.shape)}")
    if x.shape != (seg.num_tokens, seg.in_features) or out.shape != (seg.num_tokens, seg.out_features):
        raise ValueError(
            f"x {tuple(x.shape)} / out {tuple(out.shape)} do not match "
            f"{seg.num_tokens} tokens x ({seg.in_features} -> {seg.out_features})"
        )
    if out.stride(1) != 1:
        raise ValueError("out must have unit column stride (it is written in place)")
    if not (x.device == pool.device == out.device == seg.a_offsets.device):
        raise ValueError(
            f"x, pool, out and seg must share a device ({x.device}, {pool.device}, {out.device})"
        )
    return x if x.stride(1) == 1 else x.contiguous()
