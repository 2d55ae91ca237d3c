"""Speculative decoding (``speculative: ngram``) is lossless: the same tokens as without it,
greedy and seeded, for requests of several adapters verified in one mixed batch while others
join mid-flight, and across preemptions. Prompts repeat themselves so that drafts are accepted:
each test asserts some were, so it cannot pass without speculating."""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from tests.support.draft_cost import pin_draft_cost

ADAPTERS = {
    "r64-all": SampleAdapterSpec(rank=64, target_modules=LORA_TARGETS, lora_alpha=32.0, seed=14),
    "r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, lora_alpha=8.0, seed=13),
    "r8-mlp-pattern": SampleAdapterSpec(
        rank=8, target_modules=("gate_proj", "up_proj", "down_proj"), rank_pattern={"down_proj": 32},
        alpha_pattern={"up_proj": 32.0}, seed=15,
    ),
}  # fmt: skip
MAX_TOKENS = 16
TEXT = "SELECT name, email FROM users WHERE id = 5 ORDER BY name; "
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, seed=77, ignore_eos=True)
PENALISED = SamplingParams(
    max_tokens=MAX_TOKENS, temperature=0.5, seed=5, frequency_penalty=0.2, ignore_eos=True
)
# (adapter, sampling, the step it joins at): the first three start together, the others join.
REQUESTS = [
    (None, GREEDY, 0),
    ("r64-all", GREEDY, 0),
    ("r32-rslora", SEEDED, 0),
    ("r8-mlp-pattern", GREEDY, 2),
    ("r64-all", SEEDED, 2),
    ("r8-mlp-pattern", PENALISED, 5),
]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_dirs(base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(root / name, base_spec, sample) for name, sample in ADAPTERS.items()}


def run_mixed(loaded, adapter_dirs, speculative: str) -> tuple[dict[str, list[int]], Engine]:
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=256, speculative=speculative))
    pin_draft_cost(engine)
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    prompt = tuple(loaded.tokenizer.encode("Repeat this query exactly: " + TEXT * 2))
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_work():
        for i, (adapter, sampling, joins) in enumerate(REQUESTS):
            if joins == step:
                engine.submit(
                    GenerationRequest(f"r{i}", prompt[i:], sampling, adapter),
                    lambda e: e.token_id is None or tokens.setdefault(e.request_id, []).append(e.token_id),
                )
        engine.step()
        step += 1
    return tokens, engine


@pytest.mark.model
def test_mixed_adapters_greedy_and_seeded_give_the_same_tokens(loaded, adapter_dirs):
    plain, plain_engine = run_mixed(loaded, adapter_dirs, "off")
    speculated, engine = run_mixed(loaded, adapter_dirs, "ngram")
    assert speculated == plain
    assert sorted(plain) == [f"r{i}" for i in range(len(REQUESTS))]
    assert all(len(t) == MAX_TOKENS for t in plain.values())
    counts = engine.speculator.counts
    print(f"steps {engine.steps} for {len(REQUESTS) * MAX_TOKENS} tokens; {counts}")
    accepted_by = {a for a, n in counts.accepted.items() if n > 0}
    assert len(accepted_by) >= 2, f"drafts accepted for too few adapters: {counts}"
    assert engine.steps < plain_engine.steps


def test_preempted_requests_give_the_same_tokens(tiny_llama):
    def run(speculative: str, pool_mib: float) -> tuple[dict[str, list[int]], Engine]:
        model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
        engine = local_engine(
            model, EngineConfig(pool_mib=pool_mib, kv_block_tokens=4, max_running=16, speculative=speculative)
        )
        pin_draft_cost(engine)
        tokens: dict[str, list[int]] = {}
        for i in range(12):
            prompt = tuple((5 * i + j % 6) % 250 + 1 for j in range(8 + i % 5))  # a period of 6
            engine.submit(
                GenerationRequest(f"r{i}", prompt, GREEDY if i % 2 else SEEDED),
                lambda e: tokens.setdefault(e.request_id, []).append(e.token_id),
            )
        while engine.has_work():
            engine.step()
        return tokens, engine

    expected, roomy = run("off", pool_mib=8)
    assert roomy.preemptions == 0
    got, tight = run("ngram", pool_mib=0.1)
    assert got == expected
    assert tight.preemptions > 0, "the tight pool should have forced preemptions"
    assert sum(tight.speculator.counts.accepted.values()) > 0


def test_deterministic_bf16_greedy_gives_the_same_tokens(tiny_llama):
    """Under ``--deterministic`` a verifying row's logits are a decode step's to the bit, so even
    bf16 (where a longer matmul would round otherwise) gives the same tokens."""

    def run(speculative: str) -> tuple[dict[str, list[int]], Engine]:
        model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.bfloat16)
        config = EngineConfig(pool_mib=4, kv_block_tokens=4, deterministic=True, speculative=speculative)
        engine = local_engine(model, config)
        pin_draft_cost(engine)
        tokens: dict[str, list[int]] = {}
        for i in range(4):
            prompt = tuple((3 * i + j % 5) % 250 + 1 for j in range(10 + i))
            engine.submit(
                GenerationRequest(f"r{i}", prompt, GREEDY),
                lambda e: tokens.setdefault(e.request_id, []).append(e.token_id),
            )
        while engine.has_work():
            engine.step()
        return tokens, engine

    expected, _ = run("off")
    got, engine = run("ngram")
    assert got == expected
    assert sum(engine.speculator.counts.accepted.values()) > 0
