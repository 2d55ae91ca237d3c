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

import math
from dataclasses import dataclass, replace

import torch

from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.model_files.model_config import BaseModelSpec, ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections split by output columns; their LoRA intermediate is all-gathered."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections split by input columns; their LoRA intermediate is all-reduced."""

_COLUMN_WEIGHTS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "mlp.gate_proj": "inter",
    "mlp.up_proj": "inter",
}
_ROW_WEIGHTS = {"self_attn.o_proj": "q", "mlp.down_proj": "inter"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank ``rank`` of ``size``: which slice of every split dimension it holds."""

    size: int
    rank: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def for_config(cls, config: BaseModelSpec, size: int, rank: int = 0) -> TensorParallelLayout:
        """The layout of ``rank`` in a group of ``size``; ValueError naming the numbers when
        ``size`` does not divide the query heads, KV heads, intermediate size and hidden size."""
        if size < 1:
            raise ValueError(f"--tp {size}: the tensor-parallel degree must be at least 1")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        split = {
            "query heads": config.num_heads,
            "KV heads": config.num_kv_heads,
            "intermediate size": config.intermediate_size,
            "hidden size": config.hidden_size,
        }
        bad = [f"{value} {what}" for what, value in split.items() if value % size]
        if bad:
            valid = _divisors(math.gcd(*split.values()))
            listed = ", ".join(map(str, valid[:-1])) + f" or {valid[-1]}" if len(valid) > 1 else "1"
            raise ValueError(
                f"--tp {size} does not divide {config.name or 'the model'}'s {' and '.join(bad)}; "
                f"use a degree that divides all of them: {listed}"
            )
        return cls(
            size=size,
            rank=rank,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
        )

    # -- the rank's slices -----------------------------------------------------------------
    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank."""
        return self.num_kv_heads // self.size

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """This rank's KV width: its pool's ``kv_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def hidden(self) -> int:
        """This rank's column slice of the hidden size (row-parallel LoRA Bᵀ width)."""
        return self.hidden_size // self.size

    def width(self, kind: str) -> int:
        """Rank-local width of a split dimension: ``q``, ``kv``, ``inter`` or ``hidden``."""
        return {"q": self.q_dim, "kv": self.kv_dim, "inter": self.intermediate, "hidden": self.hidden}[kind]

    def slice(self, kind: str) -> slice:
        """This rank's slice of a split dimension (``q``, ``kv``, ``inter``, ``hidden``)."""
        width = self.width(kind)
        return slice(self.rank * width, (self.rank + 1) * width)

    def out_kind(self, module: str) -> str:
        """The split dimension of ``module``'s output (column-parallel) or input (row-parallel)."""
        return {
            "q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter",
            "o_proj": "q", "down_proj": "inter",
        }[module]  # fmt: skip

    def padded_rank(self, rank: int) -> int:
        """A column-parallel module's rank padded to a multiple of the degree."""
        return self.size * -(-rank // self.size)

    def shard_widths(self, module: str) -> tuple[int, int]:
        """Widths of the pool rows of ``module``'s shard: (A row, Bᵀ row)."""
        if module in COLUMN_PARALLEL:
            return self.hidden_size // self.size, self.width(self.out_kind(module))
        return self.width(self.out_kind(module)), self.hidden

    def rank_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and intermediate size: build the rank's
        ``LlamaModel`` with it (its q_dim, kv_dim and pool kv_dim are then the rank's)."""
        return replace(
            config,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
        )


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
