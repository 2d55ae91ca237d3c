"""The Triton kernel of ``grammar_bitmask``: each program reads one constrained row's bitmask words
for a block of the vocabulary and writes -inf over the logits of the tokens they do not allow.
No ``[rows, V]`` mask exists anywhere; the words are read once per block of tokens (32 tokens a
word). Importing this defines the kernel: ``TRITON_INTERPRET=1`` must be set before the first
import for it to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
"""Tokens per program."""


@triton.jit
def _mask_logits(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    words,
    stride_logits,
    stride_bitmask,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (constrained row i, token block): logits[rows[i], t] = -inf where bit t of
    bitmask[i] is 0 (tokens past the words included)."""
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = t // 32
    in_words = word < words
    bits = tl.load(bitmask_ptr + i * stride_bitmask + word, mask=(t < vocab) & in_words, other=0)
    refused = ((bits >> (t % 32)) & 1) == 0
    minus_inf = tl.full((BLOCK,), float("-inf"), tl.float32)
    ptrs = logits_ptr + row * stride_logits + t
    tl.store(ptrs, minus_inf.to(logits_ptr.dtype.element_ty), mask=(t < vocab) & refused)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``grammar_bitmask.mask_logits_`` (checked there) in one launch."""
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask must have unit column stride")
    count = bitmask.shape[0]
    _mask_logits[(count, triton.cdiv(logits.shape[1], BLOCK_V))](
        logits,
        bitmask,
        logits if rows is None else rows,  # not read without rows
        logits.shape[1],
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK_V,
    )
