"""PEFT's LoRA names, configs and rank/alpha patterns, the rules the adapter store and the worker share."""

from __future__ import annotations

import json
import math

import pytest

from services.model_files.peft_format import (
    LORA_TARGETS,
    PeftConfig,
    module_path,
    parse_tensor_name,
    pattern_value,
    tensor_name,
)
from services.runtime.errors import InvalidArgument


def test_names_are_pefts_and_parse_back():
    assert module_path(3, "q_proj") == "model.layers.3.self_attn.q_proj"
    assert module_path(3, "down_proj") == "model.layers.3.mlp.down_proj"
    assert tensor_name(0, "v_proj", "B") == "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    for layer in (0, 7, 10):
        for module in LORA_TARGETS:
            for factor in ("A", "B"):
                assert parse_tensor_name(tensor_name(layer, module, factor)) == (layer, module, factor)


@pytest.mark.parametrize(
    "name",
    [
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # q_proj is not in the MLP
        "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.mlp.act_fn.lora_A.weight",
        "base_model.model.lm_head.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",
    ],
)
def test_other_names_do_not_parse(name):
    assert parse_tensor_name(name) is None


def test_pattern_keys_match_the_path_or_its_tail_and_the_first_match_wins():
    path = module_path(12, "k_proj")
    assert pattern_value(None, path, 8) == 8
    assert pattern_value({"k_proj": 4}, path, 8) == 4
    assert pattern_value({"_proj": 4}, path, 8) == 8  # a key is whole dotted components
    assert pattern_value({r"layers\.1\d\.self_attn\.k_proj": 2, "k_proj": 4}, path, 8) == 2
    assert pattern_value({"k_proj": 4, r"layers\.1\d\.self_attn\.k_proj": 2}, path, 8) == 4
    assert pattern_value({"q_proj": 4}, path, 8) == 8


def test_the_config_gives_each_module_its_rank_alpha_and_scale():
    config = PeftConfig.from_json(
        json.dumps({
            "peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": "all-linear",
            "rank_pattern": {r"layers\.1\.self_attn\.q_proj": 4}, "alpha_pattern": {"down_proj": 2},
            "layers_to_transform": 1,
        })
    )  # fmt: skip
    assert config.targeting.target_modules == LORA_TARGETS and config.targeting.layers_to_transform == (1,)
    assert (
        config.module_rank(module_path(1, "q_proj")) == 4
        and config.module_rank(module_path(0, "q_proj")) == 8
    )
    assert config.scale(module_path(1, "q_proj")) == 16 / math.sqrt(4)
    assert config.scale(module_path(1, "down_proj")) == 2 / math.sqrt(8)
    plain = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    assert PeftConfig.from_json(json.dumps(plain)).scale(module_path(0, "q_proj")) == 16 / 8


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, "peft_type is None"),
        ({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ("q_proj", 3)}, "target_modules must be"),
        ({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": "x", "layers_pattern": 3}, "layers_pattern"),
    ],
)  # fmt: skip
def test_a_config_the_worker_cannot_serve_is_refused(config, needle):
    with pytest.raises(InvalidArgument, match=needle):
        PeftConfig.from_json(json.dumps(config))
