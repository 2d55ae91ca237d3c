"""bf16 storage with fp32 compute: which dtype the model computes in, and that a bf16-stored
model generates what the fp32 model does.

With ``compute_dtype=float32`` the only differences from the fp32 model are the roundings of
storage: every weight and every cached key/value is rounded to bf16 (8 significant bits,
relative error ≤ 2^-9). The tolerances below are about twice the differences measured on this
machine (tiny Llama: 1.8e-3 against fp32 weights, 6e-4 against the same bf16-rounded weights in
fp32, where only the KV cache rounds; SmolLM2: 0.25 on logits spanning ±32, i.e. under 1%);
greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model import compute_dtype
from services.gpu_worker.model.compute_dtype import resolve_compute_dtype
from services.gpu_worker.model.llama import LlamaModel


def generate(model: LlamaModel, prompts: list[list[int]], new_tokens: int, block: int):
    """Greedy tokens and every step's logits per request."""
    logits: dict[str, list[torch.Tensor]] = {}
    tokens: dict[str, list[int]] = {}
    engine = local_engine(
        model,
        EngineConfig(pool_mib=64, kv_block_tokens=block),
        on_logits=lambda rid, row: logits.setdefault(rid, []).append(row.clone()),
    )
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.submit(
            GenerationRequest(f"r{i}", tuple(prompt), sampling),
            lambda e: tokens.setdefault(e.request_id, []).append(e.token_id),
        )
    while engine.has_work():
        engine.step()
    return tokens, logits


def assert_same_generation(got, expected, atol: float) -> None:
    assert got[0] == expected[0], "greedy tokens differ"
    for rid, rows in expected[1].items():
        for step, (a, b) in enumerate(zip(got[1][rid], rows, strict=True)):
            torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=f"{rid} step {step}")


def bf16_rounded(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).float() for k, v in weights.items()}


def test_compute_dtype_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_compute_dtype(torch.float32, "cpu") == torch.float32
    assert resolve_compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    monkeypatch.setattr(compute_dtype, "cpu_has_half_gemm", lambda dtype: False)
    assert resolve_compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert resolve_compute_dtype(torch.float16, "cpu") == torch.float32
    monkeypatch.setattr(compute_dtype, "cpu_has_half_gemm", lambda dtype: True)
    assert resolve_compute_dtype(torch.bfloat16, "cpu") == torch.bfloat16


def test_bf16_model_stores_bf16_and_computes_as_resolved(tiny_llama) -> None:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.bfloat16)
    assert model.compute_dtype == resolve_compute_dtype(torch.bfloat16, "cpu")
    for layer in model.layers:
        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm):
            assert weight.dtype == torch.bfloat16
    assert model.embed.dtype == model.lm_head.dtype == model.norm.dtype == torch.bfloat16
    engine = local_engine(model, EngineConfig(pool_mib=4))
    assert engine.pool.buffer.dtype == torch.bfloat16


def test_bf16_storage_generates_what_fp32_does_tiny(tiny_llama) -> None:
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + 5 * i)] for i in range(5)]
    config, weights = tiny_llama.config, tiny_llama.weights
    bf16 = generate(LlamaModel(config, weights, torch.bfloat16, compute_dtype=torch.float32), prompts, 8, 4)
    fp32 = generate(LlamaModel(config, weights, torch.float32), prompts, 8, 4)
    assert_same_generation(bf16, fp32, atol=4e-3)
    # Same bf16 weights computed in fp32 with an fp32 KV cache: only the bf16 KV cache differs.
    rounded = generate(LlamaModel(config, bf16_rounded(weights), torch.float32), prompts, 8, 4)
    assert_same_generation(bf16, rounded, atol=1.5e-3)


@pytest.mark.model
def test_bf16_storage_generates_what_fp32_does_smollm2() -> None:
    from services.gpu_worker.model.loading import load_model

    loaded = load_model()
    text = "The quick brown fox jumps over the lazy dog. In the beginning the universe was created."
    ids = loaded.tokenizer.encode(text)
    prompts = [ids[:n] for n in (5, 17)]
    config, weights = loaded.config, loaded.weights
    bf16 = generate(LlamaModel(config, weights, torch.bfloat16, compute_dtype=torch.float32), prompts, 6, 16)
    fp32 = generate(LlamaModel(config, weights, torch.float32), prompts, 6, 16)
    assert_same_generation(bf16, fp32, atol=0.5)
