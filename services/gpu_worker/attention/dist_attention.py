"""DistAttention (Infinite-LLM §4.2): attention split into micro-attentions over subsets of a
request's KV blocks, combined exactly by scale-reduce.

For query ``q`` and a subset ``j`` of its keys (SEED-SPECS §1, "DistAttention"):
``s_j = q K_jᵀ / √d``, ``m_j = max s_j``, ``e_j = Σ exp(s_j − m_j)``, ``MA_j = exp(s_j − m_j) V_j``,
and ``Attn = Σ_j e^{m_j−m} MA_j / Σ_j e^{m_j−m} e_j`` with ``m = max_j m_j``.

A :class:`PartialAttention` carries the same information in the flash-decoding form: the subset's
own softmax output ``o_j = MA_j / e_j`` and its log-sum-exp ``lse_j = m_j + log e_j``. Then
``e^{m_j−m} e_j = exp(lse_j − m)`` and the reduce above becomes
``Attn = Σ_j exp(lse_j − m) o_j / Σ_j exp(lse_j − m)``. This form is what a creditor returns (one
vector and one scalar per query head), and it is closed under the reduce, so partials may be
combined in any grouping (a creditor may pre-reduce the blocks it holds).

A subset a query sees nothing of (no keys, or every key in its future) is ``o = 0``,
``lse = −inf``: it weighs exactly nothing in the reduce, and nothing here produces NaN.
Everything is computed in float32 whatever the storage dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SCORE_ELEMENTS = 1 << 24
"""Most float32 scores micro-attention materialises at once (64 MiB)."""


@dataclass(frozen=True)
class PartialAttention:
    """Attention of ``n`` queries over one subset of their keys."""

    output: torch.Tensor
    """float32 [n, num_heads, head_dim]: softmax attention over this subset's keys alone
    (normalised within the subset); zero for a query that sees none of them."""
    lse: torch.Tensor
    """float32 [n, num_heads]: log Σ exp(scores) over the keys the query sees; −inf if none."""


def empty_partial(
    num_queries: int, num_heads: int, head_dim: int, device: torch.device | str = "cpu"
) -> PartialAttention:
    """The partial of a subset with no visible keys: the identity of :func:`scale_reduce`."""
    return PartialAttention(
        output=torch.zeros(num_queries, num_heads, head_dim, dtype=torch.float32, device=device),
        lse=torch.full((num_queries, num_heads), -math.inf, dtype=torch.float32, device=device),
    )


def micro_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
) -> PartialAttention:
    """Causal attention of ``queries`` over one subset of keys.

    ``queries`` [n, num_heads, head_dim]; ``keys``/``values`` [m, num_kv_heads, head_dim] (GQA:
    query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``, as in HF and SDPA's
    ``enable_gqa``); ``query_positions`` [n] and ``key_positions`` [m] int64 token positions: the
    key at position ``k`` is visible to the query at ``p`` iff ``k <= p``. ``scale`` defaults to
    ``1/√head_dim``.
    """
    n, num_heads, head_dim = queries.shape
    num_kv_heads, m = keys.shape[1], keys.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if m == 0 or n == 0:
        return empty_partial(n, num_heads, head_dim, queries.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys, values = keys.float(), values.float()
    # Queries in chunks so the [heads, rows, m] score matrix stays bounded (a long prefill).
    rows = max(1, _SCORE_ELEMENTS // (num_heads * m))
    parts = [
        _attend_rows(queries[i : i + rows], keys, values, query_positions[i : i + rows], key_positions, scale)
        for i in range(0, n, rows)
    ]
    if len(parts) == 1:
        return parts[0]
    return PartialAttention(
        output=torch.cat([p.output for p in parts]), lse=torch.cat([p.lse for p in parts])
    )


def _attend_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
) -> PartialAttention:
    """:func:`micro_attention` of a few queries over float32 ``keys``/``values`` (m > 0)."""
    n, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = queries.float().view(n, num_kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,mhd->hgnm", q, keys) * scale  # [kv_heads, group, n, m]
    visible = key_positions[None, :] <= query_positions[:, None]  # [n, m]
    scores = scores.masked_fill(~visible, -math.inf)
    row_max = scores.amax(dim=-1)  # −inf where the query sees no key of this subset
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - shift[..., None])  # exactly 0 where masked
    total = weights.sum(dim=-1)  # e_j: ≥ 1 when any key is visible (its max term is exp(0)), else 0
    attended = torch.einsum("hgnm,mhd->nhgd", weights, values)
    # clamp_min(1) leaves every non-empty total as it is and turns 0/0 into 0/1 = 0.
    output = attended / total.clamp_min(1.0).permute(2, 0, 1)[..., None]
    lse = (shift + torch.log(total)).permute(2, 0, 1)  # log 0 = −inf for empty rows
    return PartialAttention(output=output.reshape(n, num_heads, head_dim), lse=lse.reshape(n, num_heads))


def scale_reduce(partials: Sequence[PartialAttention]) -> PartialAttention:
    """Combine partials of the same queries over disjoint key subsets into the partial of their
    union; over all of a query's keys, ``output`` is its exact attention output."""
    if not partials:
        raise ValueError("scale_reduce needs at least one partial (use empty_partial for none)")
    if len(partials) == 1:
        return partials[0]
    lse = torch.stack([p.lse for p in partials])  # [P, n, heads]
    outputs = torch.stack([p.output for p in partials])  # [P, n, heads, head_dim]
    top = lse.amax(dim=0)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - shift)  # exp(−inf) = 0: empty partials weigh nothing
    total = weights.sum(dim=0)  # ≥ 1 when any partial is non-empty (the top one weighs 1), else 0
    output = (weights[..., None] * outputs).sum(dim=0) / total.clamp_min(1.0)[..., None]
    return PartialAttention(output=output, lse=shift + torch.log(total))
