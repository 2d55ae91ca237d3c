"""Tensor-parallel sharding: refused degrees, shard shapes, and the shard math in one process
(the shards, recombined the way the collectives would, give back the full projection)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.tp_rank_group import SingleProcess
from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.gpu_worker.tp.sharding import TensorParallelLayout, shard_adapter, shard_base_weights
from services.model_files.model_config import ModelConfig

SMOLLM2 = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
    max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
    eos_token_ids=(2,), name="SmolLM2",
)  # fmt: skip


def test_tp2_on_smollm2_is_refused_naming_the_heads():
    with pytest.raises(ValueError) as err:
        TensorParallelLayout.for_config(SMOLLM2, 2)
    message = str(err.value)
    assert "--tp 2" in message and "9 query heads" in message and "3 KV heads" in message
    assert "1 or 3" in message and "intermediate" not in message
    for bad in (0, 4, 9):
        with pytest.raises(ValueError):
            TensorParallelLayout.for_config(SMOLLM2, bad)


def test_smollm2_tp3_layout():
    layout = TensorParallelLayout.for_config(SMOLLM2, 3, rank=2)
    assert (layout.heads, layout.kv_heads, layout.q_dim, layout.kv_dim) == (3, 1, 192, 64)
    assert (layout.intermediate, layout.hidden) == (512, 192)
    assert layout.slice("q") == slice(384, 576) and layout.slice("kv") == slice(128, 192)
    rank_config = layout.rank_config(SMOLLM2)
    assert (rank_config.num_heads, rank_config.num_kv_heads, rank_config.intermediate_size) == (3, 1, 512)
    assert rank_config.hidden_size == 576
    assert [layout.padded_rank(r) for r in (8, 9, 16, 64)] == [9, 9, 18, 66]


def small_config(**overrides) -> ModelConfig:
    return dataclasses.replace(
        SMOLLM2, hidden_size=48, intermediate_size=24, num_layers=1, num_heads=6, num_kv_heads=3,
        head_dim=8, vocab_size=10, **overrides,
    )  # fmt: skip


def test_base_weight_shapes():
    config = small_config()
    layout = TensorParallelLayout.for_config(config, 3, rank=1)
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    weights = {
        p + "self_attn.q_proj.weight": torch.randn(48, 48, generator=g),
        p + "self_attn.k_proj.weight": torch.randn(24, 48, generator=g),
        p + "self_attn.v_proj.weight": torch.randn(24, 48, generator=g),
        p + "self_attn.o_proj.weight": torch.randn(48, 48, generator=g),
        p + "mlp.gate_proj.weight": torch.randn(24, 48, generator=g),
        p + "mlp.up_proj.weight": torch.randn(24, 48, generator=g),
        p + "mlp.down_proj.weight": torch.randn(48, 24, generator=g),
        p + "input_layernorm.weight": torch.randn(48, generator=g),
        "model.embed_tokens.weight": torch.randn(10, 48, generator=g),
    }
    shard = shard_base_weights(weights, layout)
    assert shard[p + "self_attn.q_proj.weight"].shape == (16, 48)
    assert torch.equal(shard[p + "self_attn.q_proj.weight"], weights[p + "self_attn.q_proj.weight"][16:32])
    assert torch.equal(shard[p + "self_attn.k_proj.weight"], weights[p + "self_attn.k_proj.weight"][8:16])
    assert torch.equal(shard[p + "self_attn.o_proj.weight"], weights[p + "self_attn.o_proj.weight"][:, 16:32])
    assert shard[p + "mlp.gate_proj.weight"].shape == (8, 48)
    assert torch.equal(shard[p + "mlp.down_proj.weight"], weights[p + "mlp.down_proj.weight"][:, 8:16])
    for replicated in (p + "input_layernorm.weight", "model.embed_tokens.weight"):
        assert torch.equal(shard[replicated], weights[replicated])


@pytest.mark.parametrize("rank", [7, 9, 16])
def test_adapter_shards_recombine_exactly(rank: int):
    """Column-parallel: the gathered shrinks expanded by each rank's Bᵀ columns give the full
    delta; row-parallel: the summed partial shrinks expanded by each rank's Bᵀ columns likewise.
    No weight is held twice (padding aside), every rank's shard has the same shapes."""
    config = small_config()
    g = torch.Generator().manual_seed(rank)
    factors = {
        (0, "q_proj"): LoraFactors(torch.randn(rank, 48, generator=g), torch.randn(rank, 48, generator=g), 0.5),
        (0, "o_proj"): LoraFactors(torch.randn(rank, 48, generator=g), torch.randn(rank, 48, generator=g), 2.0),
        (0, "up_proj"): LoraFactors(torch.randn(rank, 48, generator=g), torch.randn(rank, 24, generator=g), 1.0),
        (0, "down_proj"): LoraFactors(torch.randn(rank, 24, generator=g), torch.randn(rank, 48, generator=g), 1.0),
    }  # fmt: skip
    adapter = HostAdapter("a", factors)
    layouts = [TensorParallelLayout.for_config(config, 3, k) for k in range(3)]
    shards = [shard_adapter(adapter, layout) for layout in layouts]
    for key in factors:
        assert len({(s.modules[key].a.shape, s.modules[key].b_t.shape) for s in shards}) == 1
    r_pad = layouts[0].padded_rank(rank)
    assert sum(s.nbytes for s in shards) == (adapter.nbytes + 4 * (r_pad - rank) * (48 + 48 + 48 + 24))
    x = torch.randn(5, 48, generator=g, dtype=torch.float64)
    for module, in_kind in (("q_proj", None), ("up_proj", None)):
        full = factors[(0, module)]
        expected = full.scale * (x @ full.a.double().T) @ full.b_t.double()
        shrinks = [x @ s.modules[(0, module)].a.double().reshape(r_pad // 3, 48).T for s in shards]
        gathered = torch.cat(shrinks, dim=1)  # the all-gather, in rank order
        got = torch.cat([full.scale * gathered @ s.modules[(0, module)].b_t.double() for s in shards], dim=1)
        assert torch.allclose(got, expected, atol=1e-10), module
    for module, kind in (("o_proj", "q"), ("down_proj", "inter")):
        full = factors[(0, module)]
        xin = torch.randn(5, full.a.shape[1], generator=g, dtype=torch.float64)
        expected = full.scale * (xin @ full.a.double().T) @ full.b_t.double()
        reduced = sum(
            xin[:, layout.slice(kind)] @ s.modules[(0, module)].a.double().T
            for layout, s in zip(layouts, shards)
        )  # the all-reduce
        got = torch.cat([full.scale * reduced @ s.modules[(0, module)].b_t.double() for s in shards], dim=1)
        assert torch.allclose(got, expected, atol=1e-10), module


def test_single_process_collectives_count_nothing():
    coll = SingleProcess()
    t = torch.ones(4, 3)
    assert coll.all_reduce(t, "base") is t and torch.equal(coll.all_gather(t, "lora"), t)
    assert coll.traffic.bytes() == 0
