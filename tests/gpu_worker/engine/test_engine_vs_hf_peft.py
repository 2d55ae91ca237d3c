"""The engine's output equals HF transformers + peft on the same weights.

SmolLM2-135M in fp32; 12 requests mixing 5 PEFT adapters (ranks 8/16/32/64, attention-only and
attention+MLP, one rslora, one rank_pattern) and the base model, different prompt lengths,
arriving while others run. Each request is also run alone in HF + peft. Every step's logits must
agree within 1e-3 (max abs) and greedy tokens must be identical. HF is fed the engine's token at
every step (teacher forcing), so should a near-tie (top-2 gap < 1e-4) ever pick a different
argmax, the comparison of the remaining steps stays meaningful; such a flip is reported, not
hidden, and any flip that is not a near-tie fails the test.

The same holds with ``--quantization q4_1``: the engine then multiplies the wheel's own Q4_1 (and
Q8_0 embedding) blocks with its quantized kernels, while HF runs their fp32 dequantization.
"""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.model

NEW_TOKENS = 48
ADAPTERS = {
    "r8-attn": SampleAdapterSpec(rank=8, seed=11),
    "r16-all": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=12),
    "r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, lora_alpha=8.0, seed=13),
    "r64-all": SampleAdapterSpec(rank=64, target_modules=LORA_TARGETS, lora_alpha=32.0, seed=14),
    "r8-pattern": SampleAdapterSpec(
        rank=8, target_modules=LORA_TARGETS, rank_pattern={"down_proj": 32, "layers.2.self_attn.q_proj": 16},
        alpha_pattern={"v_proj": 32.0}, seed=15,
    ),
}  # fmt: skip
PROMPT_LENGTHS = [7, 31, 12, 3, 58, 19, 44, 9, 26, 15, 5, 37]
REQUEST_ADAPTERS = ["r8-attn", None, "r16-all", "r32-rslora", "r64-all", "r8-pattern",
                    None, "r16-all", "r64-all", "r8-attn", "r8-pattern", "r32-rslora"]  # fmt: skip


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_dirs(loaded, base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(root / name, base_spec, sample) for name, sample in ADAPTERS.items()}


def prompts(loaded) -> list[list[int]]:
    text = (
        "In the beginning the universe was created. This has made a lot of people very angry and been "
        "widely regarded as a bad move. Many were increasingly of the opinion that they had all made a "
        "big mistake in coming down from the trees in the first place."
    )
    ids = loaded.tokenizer.encode(text)
    return [ids[i : i + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def references() -> dict:
    """HF + peft logits already computed, by (request index, forced tokens): the q4_1 run reuses
    the fp32 run's where their tokens agree."""
    return {}


def run_engine(loaded, adapter_dirs, quantization: str = "none") -> tuple[dict, dict]:
    weights = loaded.weights if quantization == "none" else load_model(quantization=quantization).weights
    model = LlamaModel(loaded.config, weights, torch.float32)
    assert model.quantization == quantization
    logits: dict[str, list[torch.Tensor]] = {}
    engine = local_engine(
        model,
        EngineConfig(pool_mib=256),
        on_logits=lambda rid, row: logits.setdefault(rid, []).append(row.clone()),
    )
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    tokens: dict[str, list[int]] = {}
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    all_prompts = prompts(loaded)

    def submit(i: int) -> None:
        engine.submit(
            GenerationRequest(f"r{i}", tuple(all_prompts[i]), sampling, REQUEST_ADAPTERS[i]),
            lambda event: tokens.setdefault(event.request_id, []).append(event.token_id),
        )

    for i in range(4):
        submit(i)
    steps = 0
    while engine.has_work() or steps == 0:
        engine.step()
        steps += 1
        if steps in (3, 9):  # more requests arrive while the first ones are decoding
            for i in range(4 if steps == 3 else 8, 8 if steps == 3 else 12):
                submit(i)
    assert engine.stats().kv_pages == 0  # unused cached prefix blocks count as free
    return tokens, logits


def hf_reference(loaded, adapter_dirs, prompt: list[int], adapter: str | None, forced: list[int]):
    """HF + peft logits at each step when fed ``forced`` tokens (the engine's): one forward of
    the prompt and the forced tokens, whose causal logits at each position are those of the
    step that produced the next token (one pass instead of a cached decode step per token)."""
    from peft import PeftModel
    from support.hf_llama import hf_llama

    base = hf_llama(loaded)
    model = base if adapter is None else PeftModel.from_pretrained(base, str(adapter_dirs[adapter]))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + forced[:-1]])).logits[0, len(prompt) - 1 :].float()
    return list(logits)


@pytest.mark.parametrize("quantization", ["none", "q4_1"])
def test_engine_matches_transformers_and_peft(loaded, adapter_dirs, references, quantization):
    tokens, logits = run_engine(loaded, adapter_dirs, quantization)
    all_prompts = prompts(loaded)
    near_ties = []
    for i in range(12):
        rid = f"r{i}"
        assert len(tokens[rid]) == NEW_TOKENS and len(logits[rid]) == NEW_TOKENS
        key = (i, tuple(tokens[rid]))
        if key not in references:
            references[key] = hf_reference(
                loaded, adapter_dirs, all_prompts[i], REQUEST_ADAPTERS[i], tokens[rid]
            )
        reference = references[key]
        for step, (ours, theirs) in enumerate(zip(logits[rid], reference)):
            diff = (ours - theirs).abs().max().item()
            assert diff <= 1e-3, f"{rid} ({REQUEST_ADAPTERS[i]}) step {step}: logits differ by {diff:.2e}"
            if int(theirs.argmax()) != tokens[rid][step]:
                top2 = theirs.topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < 1e-4, (
                    f"{rid} step {step}: token differs from HF and it is no near-tie ({gap:.2e})"
                )
                near_ties.append((rid, step, gap))
    assert not near_ties or print(f"near-tie flips (teacher-forced after): {near_ties}") is None
