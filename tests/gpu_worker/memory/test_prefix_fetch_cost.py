"""The prefix tier's cost model: SmolLM2-135M's prefill FLOPs per token, and a fetch chosen only
when moving the blocks beats computing them."""

from __future__ import annotations

import pytest

from services.gpu_worker.memory.prefix_fetch_cost import PrefixFetchCost, decoder_flops_per_token
from services.model_files.model_config import ModelConfig

SMOLLM2 = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
}  # fmt: skip


def test_smollm2_prefill_flops_per_token_are_twice_its_decoder_weights():
    # 30 layers × (q, o: 576×576; k, v: 576×192; gate, up, down: 576×1536) = 106.2 M weights
    assert decoder_flops_per_token(ModelConfig.from_hf_config(SMOLLM2)) == pytest.approx(
        2 * 106.17e6, rel=1e-3
    )


def test_a_fetch_is_chosen_only_when_the_lane_beats_the_prefill():
    # SmolLM2 fp32, 16-token blocks: 737,280 bytes a block, 212 MFLOP a token
    cost = PrefixFetchCost(
        16, 737_280, 212.3e6, prefill_flops_per_s=60e9, lane_bytes_per_s=400e6, round_trip_s=0.002
    )
    assert cost.prefill_s(63) == pytest.approx(3.57, rel=0.01)  # a 1,000-token prompt
    assert cost.fetch_s(63) == pytest.approx(0.118, rel=0.01)
    assert cost.worth_fetching(63) and cost.worth_fetching(1) and not cost.worth_fetching(0)
    slow_lane = PrefixFetchCost(16, 737_280, 212.3e6, 60e9, lane_bytes_per_s=1e6, round_trip_s=0.002)
    assert not slow_lane.worth_fetching(63)  # 46 s over the lane against 3.6 s of prefill
