"""Whether fetching a prefix's KV blocks from another worker beats computing them here.

Fetching costs a round trip and the blocks' bytes over the lane; computing costs the prefill's
FLOPs (about two per weight per token in the decoder layers, the logits excluded: only the
prompt's last token needs them, and it is always computed). Rates are the operator's figures
for this worker and link (``--prefix-fetch-mb-s``, ``--prefill-gflops``); the defaults are
measured on loopback and on the 2-vCPU benchmark machine (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.model_files.model_config import ModelConfig


def decoder_flops_per_token(config: ModelConfig) -> float:
    """Multiply-adds ×2 of one token through every decoder layer's projections."""
    hidden, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    attention = 2 * hidden * config.num_heads * config.head_dim + 2 * hidden * kv
    mlp = 3 * hidden * config.intermediate_size
    return 2.0 * config.num_layers * (attention + mlp)


@dataclass(frozen=True)
class PrefixFetchCost:
    """The cost model of one worker."""

    block_tokens: int
    """Tokens per KV block."""
    block_bytes: int
    """Bytes of one block over the wire (every layer's keys and values)."""
    flops_per_token: float
    """Prefill FLOPs of one token here (:func:`decoder_flops_per_token`)."""
    prefill_flops_per_s: float
    """What this worker's prefill achieves."""
    lane_bytes_per_s: float
    """What a fetch moves per second."""
    round_trip_s: float
    """A lookup and a fetch's fixed cost."""

    def fetch_s(self, blocks: int) -> float:
        return self.round_trip_s + blocks * self.block_bytes / self.lane_bytes_per_s

    def prefill_s(self, blocks: int) -> float:
        return blocks * self.block_tokens * self.flops_per_token / self.prefill_flops_per_s

    def worth_fetching(self, blocks: int) -> bool:
        """Fetching ``blocks`` blocks is expected to take less time than computing them."""
        return blocks > 0 and self.fetch_s(blocks) < self.prefill_s(blocks)
