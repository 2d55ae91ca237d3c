"""validate_adapter: valid PEFT adapters pass; each bad input is refused with a message naming it."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors
from support.adapter_bytes import join, poke, split, with_config

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import ATTENTION_PROJECTIONS, LORA_TARGETS, PeftConfig, tensor_name
from services.runtime.errors import InvalidArgument, ResourceExhausted

LIMITS = ValidationLimits()
Q_A = tensor_name(0, "q_proj", "A")
Q_B = tensor_name(0, "q_proj", "B")


@pytest.fixture(scope="module")
def spec():
    return load_base_model_spec()


@pytest.fixture(scope="module")
def make(spec, tmp_path_factory):
    """Write a sample adapter for the real base model; return (config bytes, safetensors bytes)."""

    def make(**sample) -> tuple[bytes, bytes]:
        directory = write_peft_adapter(tmp_path_factory.mktemp("adapter"), spec, SampleAdapterSpec(**sample))
        files = adapter_files(directory)
        return files["adapter_config.json"], files["adapter_model.safetensors"]

    return make


@pytest.fixture(scope="module")
def good(make):
    """A valid rank-8 float16 attention-only adapter."""
    return make()


def with_tensors(data: bytes, drop=(), **replace: np.ndarray) -> bytes:
    """Re-save a float16/float32 safetensors file with tensors dropped, replaced or added."""
    tensors = {k: v for k, v in load_tensors(data).items() if k not in drop}
    tensors.update(replace)
    return save_tensors(tensors, metadata={"format": "pt"})


def refused(config: bytes, data: bytes, spec, *needles: str, limits=LIMITS, error=InvalidArgument) -> str:
    """Assert validation raises ``error`` with every needle in its message; return the message."""
    with pytest.raises(error) as info:
        validate_adapter(config, data, spec, limits)
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value.message


# --- valid adapters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample, max_rank",
    [
        ({"rank": 8}, 8),
        ({"rank": 64, "target_modules": LORA_TARGETS}, 64),
        ({"rank": 16, "target_modules": LORA_TARGETS, "use_rslora": True, "dtype": "float32"}, 16),
        (
            {
                "rank": 8,
                "rank_pattern": {"q_proj": 16, "layers.3.mlp.down_proj": 32},
                "target_modules": LORA_TARGETS,
            },
            32,
        ),
        ({"rank": 8, "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"k_proj": 32.0}}, 8),
        ({"rank": 8, "dtype": "bfloat16", "target_modules": ("q_proj", "v_proj")}, 8),
        ({"rank": 64, "dtype": "float32", "target_modules": ("gate_proj", "up_proj", "down_proj")}, 64),
    ],
)
def test_valid_adapter_passes(make, spec, sample, max_rank):
    config, data = make(**sample)
    result = validate_adapter(config, data, spec, LIMITS)
    sample = SampleAdapterSpec(**sample)
    assert result.config.rank == sample.rank
    assert result.max_rank == max_rank
    assert result.config.alpha == sample.lora_alpha
    assert result.config.use_rslora == sample.use_rslora
    assert result.target_modules == tuple(sorted(sample.target_modules))
    assert result.dtype == sample.dtype
    assert result.num_tensors == 2 * len(sample.target_modules) * spec.num_layers
    assert result.layers == tuple(range(spec.num_layers))
    assert result.config == PeftConfig.from_json(config)


def test_rank_pattern_sets_each_module_rank(make, spec):
    config, data = make(
        rank=8, rank_pattern={"q_proj": 16, "layers.3.mlp.down_proj": 32}, target_modules=LORA_TARGETS
    )
    header, _ = split(data)
    assert header[tensor_name(5, "q_proj", "A")]["shape"] == [16, spec.hidden_size]
    assert header[tensor_name(3, "down_proj", "B")]["shape"] == [spec.hidden_size, 32]
    assert header[tensor_name(4, "down_proj", "B")]["shape"] == [spec.hidden_size, 8]
    # The same tensors under a config without the pattern no longer fit the base model.
    refused(with_config(config, rank_pattern={}), data, spec, "has shape [16, 576], expected [8, 576]")


def test_regex_and_all_linear_targets(make, spec):
    config, data = make(target_modules=ATTENTION_PROJECTIONS)
    regex = with_config(config, target_modules=r".*\.self_attn\.(q|k|v|o)_proj")
    assert validate_adapter(regex, data, spec, LIMITS).target_modules == (
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    )
    refused(with_config(config, target_modules=r".*\.(q|k|v)_proj"), data, spec, "o_proj", "does not target")
    config, data = make(target_modules=LORA_TARGETS)
    assert (
        validate_adapter(with_config(config, target_modules="all-linear"), data, spec, LIMITS).num_tensors
        == 420
    )


def test_layers_to_transform_limits_the_layers(good, spec):
    config, data = good
    kept = [
        k
        for k in load_tensors(data)
        if k.startswith(("base_model.model.model.layers.0.", "base_model.model.model.layers.7."))
    ]
    dropped = [k for k in load_tensors(data) if k not in kept]
    subset = with_tensors(data, drop=dropped)
    result = validate_adapter(with_config(config, layers_to_transform=[0, 7]), subset, spec, LIMITS)
    assert result.layers == (0, 7)
    assert result.num_tensors == 2 * 4 * 2  # two layers, four projections, A and B
    # All 30 layers' tensors but a config that adapts only layer 0 and 7: layer 1 is not targeted.
    refused(
        with_config(config, layers_to_transform=[0, 7]), data, spec, "layers.1.self_attn", "does not target"
    )
    refused(with_config(config, layers_to_transform=[0, 30]), subset, spec, "layers_to_transform", "[0, 30)")


def test_exclude_modules_removes_targets(good, spec):
    config, data = good
    o_proj = [k for k in load_tensors(data) if ".o_proj." in k]
    excluded = with_config(config, exclude_modules=["o_proj"])
    assert validate_adapter(excluded, with_tensors(data, drop=o_proj), spec, LIMITS).target_modules == (
        "k_proj",
        "q_proj",
        "v_proj",
    )
    refused(excluded, data, spec, "o_proj", "does not target")
    refused(with_config(config, exclude_modules=7), data, spec, "exclude_modules must be")


# --- size ------------------------------------------------------------------------------------------


def test_size_over_the_limit(good, spec):
    config, data = good
    size = len(config) + len(data)
    limits = ValidationLimits(max_adapter_bytes=size - 1)
    refused(
        config,
        data,
        spec,
        "max_adapter_bytes",
        str(size),
        str(size - 1),
        limits=limits,
        error=ResourceExhausted,
    )
    assert validate_adapter(config, data, spec, ValidationLimits(max_adapter_bytes=size)).config.rank == 8


# --- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, needles",
    [
        (b"{not json", ["adapter_config.json", "not valid JSON"]),
        (b"\xff\xfe{}", ["adapter_config.json", "UTF-8"]),
        (b"[1, 2]", ["adapter_config.json", "JSON object"]),
    ],
)
def test_bad_json_config(good, spec, config, needles):
    refused(config, good[1], spec, *needles)


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"peft_type": "IA3"}, ["peft_type", "IA3"]),
        ({"task_type": "SEQ_CLS"}, ["task_type", "SEQ_CLS"]),
        ({"r": ...}, ["no r"]),
        ({"r": 0}, ["r must be a positive integer"]),
        ({"r": 8.0}, ["r must be a positive integer"]),
        ({"lora_alpha": -1}, ["lora_alpha must be a positive number"]),
        ({"lora_alpha": "16"}, ["lora_alpha must be a positive number"]),
        ({"target_modules": ["q_proj", "embed_tokens"]}, ["model.embed_tokens", "LoRA on embed_tokens"]),
        ({"target_modules": ["q_proj", "lm_head"]}, ["'lm_head'", "LoRA on lm_head"]),
        ({"target_modules": r".*(q_proj|lm_head)"}, ["'lm_head'", "LoRA on lm_head"]),
        ({"target_modules": ["q_proj", "self_attn"]}, ["self_attn", "not supported"]),
        ({"target_modules": ["q_proj", "c_attn"]}, ["'c_attn'", "not a module of the base model"]),
        ({"target_modules": 3}, ["target_modules must be"]),
        ({"target_modules": r"(unclosed"}, ["target_modules", "not a valid regex"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "lm_head"]),
        ({"use_dora": True}, ["use_dora", "DoRA"]),
        ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
        ({"lora_bias": True}, ["lora_bias"]),
        ({"trainable_token_indices": [1, 2]}, ["trainable_token_indices"]),
        ({"bias": "all"}, ["bias", "'all'"]),
        ({"use_rslora": "yes"}, ["use_rslora"]),
        ({"rank_pattern": ["q_proj"]}, ["rank_pattern must be an object"]),
        ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern['q_proj']", "positive integer"]),
        ({"alpha_pattern": {"q_proj": float("inf")}}, ["alpha_pattern['q_proj']", "positive number"]),
        ({"layers_to_transform": "all"}, ["layers_to_transform"]),
        # User regexes are matched by backtracking: nothing that could take exponential time.
        ({"target_modules": r"(.*.*)*y"}, ["target_modules", "repeats a group"]),
        ({"exclude_modules": r"(.|.)*y"}, ["exclude_modules", "repeats a group"]),
        ({"rank_pattern": {r".*.*.*.*y": 4}}, ["rank_pattern key", "4 repetitions", "at most 3"]),
        ({"alpha_pattern": {f"layers.{i}.q_proj": 4 for i in range(211)}}, ["alpha_pattern has 211 keys"]),
        ({"layers_to_transform": [0], "layers_pattern": "h"}, ["selects no module"]),
    ],
)
def test_bad_config_field(good, spec, changes, needles):
    refused(with_config(good[0], **changes), good[1], spec, *needles)


def test_unknown_config_fields_are_ignored(good, spec):
    config = with_config(good[0], lora_dropout=0.3, some_future_field={"x": 1}, task_type=None)
    assert validate_adapter(config, good[1], spec, LIMITS).config.rank == 8


def test_rank_above_the_maximum(make, spec):
    config, data = make(rank=16)
    refused(config, data, spec, "r=16", "maximum rank 8", limits=ValidationLimits(max_rank=8))
    config, data = make(rank=8, rank_pattern={"q_proj": 128})
    refused(config, data, spec, "rank_pattern['q_proj']=128", "maximum rank 64")


# --- safetensors container ------------------------------------------------------------------------


def test_truncated_safetensors(good, spec):
    config, data = good
    header, body = split(data)
    last = next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] == len(body))
    refused(config, data[:-100], spec, "truncated", "out of bounds", last)
    refused(config, data[:5], spec, "truncated", "5 bytes")


def test_header_length_larger_than_the_file(good, spec):
    config, data = good
    (n,) = struct.unpack_from("<Q", data)
    refused(config, data[: 8 + n - 1], spec, f"header length {n} larger than the file ({8 + n - 1} bytes)")
    refused(config, struct.pack("<Q", 0) + data[8:], spec, "header length 0")
    refused(config, struct.pack("<Q", 2**40) + data[8:], spec, f"header length {2**40}")


def test_header_not_json(good, spec):
    refused(good[0], struct.pack("<Q", 4) + b"{{{{", spec, "header is not UTF-8 JSON")


def test_overlapping_data_offsets(good, spec):
    config, data = good
    header, body = split(data)
    begin, end = header[Q_B]["data_offsets"]
    header[Q_B]["data_offsets"] = [begin - 2, end - 2]
    refused(config, join(header, body), spec, "overlap", Q_B)


def test_gap_in_data_offsets(good, spec):
    config, data = good
    header, body = split(data)
    begin = header[Q_B]["data_offsets"][0]
    for info in header.values():
        if "data_offsets" in info and info["data_offsets"][0] >= begin:
            info["data_offsets"] = [o + 16 for o in info["data_offsets"]]
    refused(config, join(header, body[:begin] + bytes(16) + body[begin:]), spec, "gap of 16 bytes", Q_B)


def test_trailing_bytes_after_the_tensors(good, spec):
    refused(good[0], good[1] + bytes(8), spec, "8 trailing bytes")


def test_data_offsets_not_matching_the_shape(good, spec):
    config, data = good
    header, body = split(data)
    header[Q_A]["shape"] = [8, 575]
    refused(config, join(header, body), spec, Q_A, "shape [8, 575]", "needs 9200")


# --- dtype ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, name", [(np.int32, "I32"), (np.int8, "I8"), (np.float64, "F64")])
def test_unsupported_dtype(good, spec, dtype, name):
    config, data = good
    bad = with_tensors(data, **{Q_A: np.ones((8, spec.hidden_size), dtype=dtype)})
    refused(config, bad, spec, Q_A, f"dtype {name}", "F16, BF16, F32")


def test_mixed_dtypes(good, spec):
    config, data = good
    bad = with_tensors(data, **{Q_A: np.ones((8, spec.hidden_size), dtype=np.float32)})
    refused(config, bad, spec, "mixes dtypes F16, F32")


# --- names ---------------------------------------------------------------------------------------------


def test_lora_embedding_tensor(good, spec):
    config, data = good
    embedding = {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 4), np.float16)}
    refused(
        config,
        with_tensors(data, **embedding),
        spec,
        "lora_embedding_A",
        "LoRA on embed_tokens is not supported",
    )


def test_lm_head_tensor(good, spec):
    config, data = good
    head = {"base_model.model.lm_head.lora_A.weight": np.zeros((8, spec.hidden_size), np.float16)}
    refused(config, with_tensors(data, **head), spec, "base_model.model.lm_head.lora_A.weight", "lm_head")


def test_dora_magnitude_tensor(good, spec):
    config, data = good
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    refused(config, with_tensors(data, **{name: np.ones(spec.hidden_size, np.float16)}), spec, name, "DoRA")


def test_missing_b_for_an_a(good, spec):
    config, data = good
    refused(config, with_tensors(data, drop=[Q_B]), spec, "missing tensor", Q_B)


@pytest.mark.parametrize(
    "name",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",  # not PEFT's saved form
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # q_proj is not in the MLP
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight",
    ],
)
def test_unknown_tensor_name(good, spec, name):
    config, data = good
    refused(
        config,
        with_tensors(data, **{name: np.zeros((8, spec.hidden_size), np.float16)}),
        spec,
        name,
        "unknown tensor",
    )


def test_layer_beyond_the_base_model(good, spec):
    config, data = good
    name = tensor_name(30, "q_proj", "A")
    bad = with_tensors(data, **{name: np.zeros((8, spec.hidden_size), np.float16)})
    refused(config, bad, spec, name, "layer 30", "30 layers")


def test_tensor_for_an_untargeted_module(good, spec):
    config, data = good
    name = tensor_name(0, "gate_proj", "A")
    bad = with_tensors(data, **{name: np.zeros((8, spec.hidden_size), np.float16)})
    refused(config, bad, spec, name, "does not target")


# --- shapes ---------------------------------------------------------------------------------------------


def test_shape_not_matching_the_base_model(spec, tmp_path):
    other = dataclasses.replace(spec, hidden_size=640)  # a different base model
    files = adapter_files(write_peft_adapter(tmp_path, other, SampleAdapterSpec(target_modules=("q_proj",))))
    refused(
        files["adapter_config.json"],
        files["adapter_model.safetensors"],
        spec,
        Q_A,
        "[8, 640]",
        "expected [8, 576]",
    )


def test_b_shape_not_matching(good, spec):
    config, data = good
    name = tensor_name(2, "k_proj", "B")
    bad = with_tensors(data, **{name: np.zeros((spec.hidden_size, 8), np.float16)})  # k_proj's out is 192
    refused(config, bad, spec, name, "[576, 8]", "expected [192, 8]")


# --- values ---------------------------------------------------------------------------------------------

NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000}
INF = {"float16": 0x7C00, "bfloat16": 0xFF80, "float32": 0xFF800000}  # +Inf, -Inf, -Inf


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "name, element", [(tensor_name(17, "v_proj", "B"), 5), (tensor_name(29, "o_proj", "B"), -1)]
)
def test_nan_or_inf_weights(make, spec, dtype, bits, name, element):
    config, data = make(dtype=dtype)
    assert validate_adapter(config, data, spec, LIMITS).dtype == dtype
    refused(config, poke(data, name, element, bits[dtype]), spec, name, "NaN or Inf")


MAX = {"float16": 0x7BFF, "bfloat16": 0x7F7F, "float32": 0x7F7FFFFF}
SIGN = {"float16": 0x8000, "bfloat16": 0x8000, "float32": 0x80000000}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_largest_finite_values_pass(make, spec, dtype):
    config, data = make(dtype=dtype)
    data = poke(data, Q_A, 0, MAX[dtype])
    data = poke(data, Q_B, -1, MAX[dtype] | SIGN[dtype])
    assert validate_adapter(config, data, spec, LIMITS).dtype == dtype


# --- robustness -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_files_are_refused_cleanly(good, spec, data):
    """Any corruption of either file gives InvalidArgument (never another exception) or passes."""
    config, weights = good
    which = data.draw(st.sampled_from(["config", "header", "weights", "truncate"]))
    (n,) = struct.unpack_from("<Q", weights)
    if which == "truncate":
        weights = weights[: data.draw(st.integers(0, len(weights) - 1))]
    else:
        blob = bytearray(config if which == "config" else weights)
        hi = len(blob) - 1 if which != "header" else 8 + n - 1
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(0, hi))] = data.draw(st.integers(0, 255))
        if which == "config":
            config = bytes(blob)
        else:
            weights = bytes(blob)
    try:
        validate_adapter(config, weights, spec, LIMITS)
    except InvalidArgument as exc:
        assert exc.message
