"""How one rank of a tensor-parallel group holds the base model and every adapter.

Base (Megatron-LM): q/k/v, gate and up are *column-parallel* (split by output rows of the HF
``[out, in]`` weight: q by query heads, k/v by KV heads, gate/up by intermediate columns); o and
down are *row-parallel* (split by input columns), so each rank's o/down output is a partial sum
that one all-reduce per pair completes. Embedding, LM head and norms are replicated.

LoRA (S-LoRA §6), no weight replicated:

- column-parallel projection (q, k, v, gate, up): ``A1`` ``[r, in]`` is split along the rank
  dimension (rank ``k`` holds rows ``k*r/N .. (k+1)*r/N`` of A, full input width), ``B1ᵀ``
  ``[r, out]`` along its output columns (all ``r`` rows, this rank's output slice). ``x @ A1_kᵀ``
  is a column slice of the ``[T, r]`` intermediate; an all-gather completes it, and the rank
  expands it into its own output slice.
- row-parallel projection (o, down): ``A2`` is split along its input columns (all ``r`` rows,
  width ``in/N``: the rank's slice of the attention heads / intermediate) and ``B2ᵀ`` along its
  output columns (all ``r`` rows, width ``hidden/N``). ``x_k @ A2_kᵀ`` is a partial sum; an
  all-reduce of the ``[T, r]`` intermediate completes it; the rank adds ``scale * s @ B2_kᵀ`` into
  its column slice of its o/down partial output before the base all-reduce, which so also does
  the all-gather of the LoRA output.

Padding: a column-parallel module's rank ``r`` is padded with zero rows of A and Bᵀ to
``r_pad = N * ceil(r / N)`` so every rank's shard has the same shape (zero rows of A give zero
intermediate columns, which meet zero rows of Bᵀ: they contribute exactly 0.0 to every output).
Equal shapes mean equal pool placement on every rank, so one plan addresses all of them, and
the all-gather's pieces have equal sizes.

Pool packing: :func:`shard_adapter` returns a :class:`HostAdapter` whose factors are what the
rank pages into its pool, each module with as many A rows as Bᵀ rows (``AdapterResidency``
places them in pairs):

- column-parallel: ``a`` = the rank's A rows ``[r_pad/N, in]`` reshaped to ``[r_pad, in/N]``
  (the same elements, in order), ``b_t`` = ``[r_pad, out/N]``;
- row-parallel: ``a`` = ``[r, in/N]``, ``b_t`` = ``[r, hidden/N]``.

These are *shard factors*, not a LoRA of their own: only :mod:`tp.context` reads them.
"""

from __future__ import annotations

import torch

from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.gpu_worker.tp.layout import COLUMN_PARALLEL, ROW_PARALLEL, TensorParallelLayout

_COLUMN_WEIGHTS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "mlp.gate_proj": "inter",
    "mlp.up_proj": "inter",
}
_ROW_WEIGHTS = {"self_attn.o_proj": "q", "mlp.down_proj": "inter"}


def shard_base_weights(
    weights: dict[str, torch.Tensor], layout: TensorParallelLayout
) -> dict[str, torch.Tensor]:
    """The rank's base weights (HF names, ``[out, in]``), Megatron-style; views where possible."""
    out = {}
    for name, tensor in weights.items():
        sharded = tensor
        for module, kind in _COLUMN_WEIGHTS.items():
            if f".{module}." in name:
                sharded = tensor[layout.slice(kind)]  # weight rows / bias entries
        for module, kind in _ROW_WEIGHTS.items():
            if f".{module}." in name:
                if name.endswith(".bias"):
                    raise ValueError(f"{name}: row-parallel biases are not supported")
                sharded = tensor[:, layout.slice(kind)]
        out[name] = sharded.contiguous()
    return out


def shard_factors(module: str, factors: LoraFactors, layout: TensorParallelLayout) -> LoraFactors:
    """The pool-packed shard of one module's LoRA (see the module docstring); scale unchanged."""
    n, k = layout.size, layout.rank
    if module in COLUMN_PARALLEL:
        r, r_pad = factors.rank, layout.padded_rank(factors.rank)
        a, b_t = factors.a, factors.b_t[:, layout.slice(layout.out_kind(module))]
        if r_pad != r:
            a = torch.cat([a, a.new_zeros(r_pad - r, a.shape[1])])
            b_t = torch.cat([b_t, b_t.new_zeros(r_pad - r, b_t.shape[1])])
        per_rank = r_pad // n
        a = a[k * per_rank : (k + 1) * per_rank].reshape(r_pad, a.shape[1] // n)
        return LoraFactors(a=a.contiguous(), b_t=b_t.contiguous(), scale=factors.scale)
    if module in ROW_PARALLEL:
        return LoraFactors(
            a=factors.a[:, layout.slice(layout.out_kind(module))].contiguous(),
            b_t=factors.b_t[:, layout.slice("hidden")].contiguous(),
            scale=factors.scale,
        )
    raise ValueError(f"unknown LoRA target {module!r}")


def shard_adapter(adapter: HostAdapter, layout: TensorParallelLayout) -> HostAdapter:
    """The rank's shard of ``adapter``, pool-packed (same id; same shapes on every rank)."""
    return HostAdapter(
        adapter_id=adapter.adapter_id,
        modules={key: shard_factors(key[1], f, layout) for key, f in adapter.modules.items()},
        content_sha256=adapter.content_sha256,
    )


def shard_rank(module: str, rank: int, layout: TensorParallelLayout) -> int:
    """Rows of ``module``'s LoRA intermediate one token moves in a collective: ``r_pad`` for a
    column-parallel module (all-gathered), ``r`` for a row-parallel one (all-reduced)."""
    return layout.padded_rank(rank) if module in COLUMN_PARALLEL else rank
