"""A PEFT adapter parsed into per-projection factors: PEFT's names, patterns and scales."""

from __future__ import annotations

import hashlib
import json
import math
import pickle

import pytest
import torch
from safetensors.torch import save

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.lora.host_adapter import parse_peft_adapter
from services.model_files.base_model import BaseModelSpec
from services.model_files.peft_format import tensor_name
from services.runtime.errors import InvalidArgument

SPEC = BaseModelSpec(
    name="tiny", hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, vocab_size=64,
)  # fmt: skip


def test_ranks_and_scales_follow_the_patterns(tmp_path):
    sample = SampleAdapterSpec(
        rank=8, lora_alpha=16.0, target_modules=("q_proj", "down_proj"), use_rslora=True,
        rank_pattern={r"layers\.1\.self_attn\.q_proj": 4}, alpha_pattern={"down_proj": 2.0},
    )  # fmt: skip
    adapter = read_peft_directory("a", write_peft_adapter(tmp_path, SPEC, sample), torch.float32)
    assert sorted(adapter.modules) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    assert adapter.modules[(0, "q_proj")].rank == 8 and adapter.modules[(1, "q_proj")].rank == 4
    assert adapter.modules[(0, "q_proj")].scale == pytest.approx(16.0 / math.sqrt(8))
    assert adapter.modules[(1, "q_proj")].scale == pytest.approx(16.0 / math.sqrt(4))
    assert adapter.modules[(1, "down_proj")].scale == pytest.approx(2.0 / math.sqrt(8))
    assert adapter.modules[(1, "down_proj")].b_t.shape == (8, SPEC.hidden_size)


@pytest.mark.parametrize(
    "name",
    [
        tensor_name(0, "q_proj", "A").replace("layers.0.", "layers.00."),
        tensor_name(0, "q_proj", "A").replace("self_attn", "mlp"),
    ],
)
def test_a_name_the_store_would_refuse_is_refused(name):
    config = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]})
    weights = save({name: torch.zeros(8, SPEC.hidden_size)})
    with pytest.raises(InvalidArgument, match="unexpected tensor"):
        parse_peft_adapter("a", config, weights, torch.float32)


def test_the_factors_are_views_of_one_buffer_sent_once_when_pickled(tmp_path):
    """One buffer, so that a placement in its order is written in one copy; pickled (to a
    tensor-parallel rank) as that buffer once, not once per factor viewing it."""
    sample = SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj", "down_proj"))
    adapter = read_peft_directory("a", write_peft_adapter(tmp_path, SPEC, sample), torch.bfloat16)
    assert adapter.rows is not None and adapter.rows.dtype == torch.bfloat16
    assert adapter.rows.numel() * 2 == adapter.nbytes
    offset = 0
    for factors in adapter.modules.values():
        for matrix in (factors.a, factors.b_t):
            assert matrix.data_ptr() == adapter.rows.data_ptr() + 2 * offset  # in modules' order
            offset += matrix.numel()
    sent = pickle.dumps(adapter)
    assert len(sent) < 2 * adapter.nbytes
    again = pickle.loads(sent)
    assert again.adapter_id == adapter.adapter_id and again.content_sha256 == adapter.content_sha256
    for key, factors in adapter.modules.items():
        assert torch.equal(again.modules[key].a, factors.a) and torch.equal(
            again.modules[key].b_t, factors.b_t
        )
        assert again.modules[key].scale == factors.scale
        assert again.modules[key].a.untyped_storage().data_ptr() == again.rows.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked host memory needs CUDA")
def test_a_pinned_copy_keeps_every_factor_as_a_view_of_its_page_locked_rows(tmp_path):
    sample = SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj"))
    adapter = read_peft_directory("a", write_peft_adapter(tmp_path, SPEC, sample), torch.bfloat16)
    pinned = adapter.pinned()
    assert pinned.rows.is_pinned() and torch.equal(pinned.rows, adapter.rows)
    assert pinned.adapter_id == adapter.adapter_id and pinned.content_sha256 == adapter.content_sha256
    for key, factors in pinned.modules.items():
        assert factors.a.untyped_storage().data_ptr() == pinned.rows.untyped_storage().data_ptr()
        assert (
            torch.equal(factors.b_t, adapter.modules[key].b_t) and factors.scale == adapter.modules[key].scale
        )


def test_a_verified_weights_digest_names_the_same_content_as_hashing_the_weights(tmp_path):
    """A fetch hands the weights' sha256 it verified on: the content named (the prefix cache's
    key space) is the one the weights' own hash names, and another config names another."""
    directory = write_peft_adapter(tmp_path, SPEC, SampleAdapterSpec(rank=4, target_modules=("q_proj",)))
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    digest = hashlib.sha256(weights).hexdigest()
    hashed = parse_peft_adapter("a", config, weights, torch.float32)
    given = parse_peft_adapter("a", config, bytearray(weights), torch.float32, weights_sha256=digest)
    assert hashed.content_sha256 == given.content_sha256 != ""
    assert torch.equal(hashed.rows, given.rows)
    other_config = json.dumps({**json.loads(config), "lora_alpha": 3.0})
    other = parse_peft_adapter("a", other_config, weights, torch.float32)
    assert other.content_sha256 != hashed.content_sha256
