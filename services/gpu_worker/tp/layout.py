"""A tensor-parallel rank's layout: which slice of every split dimension rank ``rank`` of
``size`` holds, over the base model's dimensions alone (no torch), so that ``loramesh up`` can
refuse a degree the model does not divide before any worker loads it. ``sharding`` cuts the
weights and adapters by it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from services.model_files.model_config import BaseModelSpec, ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections split by output columns; their LoRA intermediate is all-gathered."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections split by input columns; their LoRA intermediate is all-reduced."""


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
