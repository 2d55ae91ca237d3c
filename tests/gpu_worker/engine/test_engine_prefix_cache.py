"""The prefix cache in the engine: KV of a shared prompt prefix is reused by the same adapter
version only, and outputs equal cache-free runs.

SmolLM2-135M in fp32 with real PEFT adapters, greedy: one prompt sent to two adapters shares
nothing; prompts sharing a prefix on one adapter hit the cache (whole blocks, the last prompt
token recomputed); two versions of one adapter id share nothing. On the tiny Llama, a pool under
pressure frees unused cached blocks before it preempts anything, and every reference is given
back.
"""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.cpu_invariant import invariant_available
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

NEW_TOKENS = 8
BLOCK = 16
ADAPTERS = {
    "sql": SampleAdapterSpec(rank=8, scale=0.2, seed=31),
    "chat": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=32),
    "chat-v2": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=33),
}
"""Scaled so that each visibly changes the greedy output."""
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, name your sources, and never make "
    "up facts. If a question is ambiguous, say which reading you answer."
)


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def model(loaded):
    return LlamaModel(loaded.config, loaded.weights, torch.float32)


@pytest.fixture(scope="module")
def adapter_dirs(base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-cache-adapters")
    return {name: write_peft_adapter(root / name, base_spec, sample) for name, sample in ADAPTERS.items()}


def make_engine(
    model, adapter_dirs, prefix_cache: bool, versions: dict[str, str] | None = None, **config
) -> Engine:
    """An engine with ``versions`` (adapter id -> the sample its content comes from) loaded."""
    engine = local_engine(
        model, EngineConfig(pool_mib=64, kv_block_tokens=BLOCK, prefix_cache=prefix_cache, **config)
    )
    for adapter_id, sample in (versions or {"sql": "sql", "chat": "chat"}).items():
        engine.add_adapter(read_peft_directory(adapter_id, adapter_dirs[sample], torch.float32))
    return engine


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Greedy tokens of ``requests``, run together."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request, lambda e: e.token_id is not None and tokens[e.request_id].append(e.token_id))
    while engine.has_work():
        engine.step()
    return tokens


def request(request_id: str, prompt: list[int], adapter: str | None) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return GenerationRequest(request_id, tuple(prompt), sampling, adapter)


def prompt(loaded, question: str) -> list[int]:
    return loaded.tokenizer.encode(f"{SYSTEM}\nQuestion: {question}\nAnswer:")


def assert_no_references_left(engine: Engine) -> None:
    stats = engine.prefix_cache.stats()
    assert stats.evictable_blocks == stats.cached_blocks and engine.stats().kv_pages == 0


@pytest.mark.model
def test_one_prompt_on_two_adapters_shares_nothing(loaded, model, adapter_dirs):
    ids = prompt(loaded, "Which table holds the orders?")
    assert len(ids) > 2 * BLOCK
    cached = make_engine(model, adapter_dirs, prefix_cache=True)
    got = {**run(cached, [request("sql", ids, "sql")]), **run(cached, [request("chat", ids, "chat")])}
    stats = cached.prefix_cache.stats()
    assert stats.hit_blocks == 0 and stats.missed_blocks == 2 * (len(ids) // BLOCK)
    plain = make_engine(model, adapter_dirs, prefix_cache=False)
    assert got == run(plain, [request("sql", ids, "sql"), request("chat", ids, "chat")])
    assert got["sql"] != got["chat"]  # the adapters do differ on this prompt
    assert_no_references_left(cached)


@pytest.mark.model
def test_a_shared_prefix_on_one_adapter_hits_and_changes_no_output(loaded, model, adapter_dirs):
    questions = [
        "Who wrote Hamlet?",
        "How far is the Moon?",
        "What is a prime number?",
        "Why is the sky blue?",
    ]
    prompts = [prompt(loaded, q) for q in questions]
    # Sequential first (the cache holds the first prompt's blocks), then three together, one of
    # them on the base model (its own key space), one repeating a whole prompt.
    first = [request("r0", prompts[0], "chat")]
    together = [
        request("r1", prompts[1], "chat"),
        request("r2", prompts[2], None),
        request("r3", prompts[0], "chat"),
        request("r4", prompts[3], "chat"),
    ]
    cached = make_engine(model, adapter_dirs, prefix_cache=True)
    got = {**run(cached, first), **run(cached, together)}
    shared_blocks = len(loaded.tokenizer.encode(SYSTEM)) // BLOCK
    stats = cached.prefix_cache.stats()
    assert stats.hit_blocks >= 3 * shared_blocks > 0
    plain = make_engine(model, adapter_dirs, prefix_cache=False)
    expected = {**run(plain, first), **run(plain, together)}
    assert got == expected
    assert got["r3"] == got["r0"]
    assert_no_references_left(cached)


@pytest.mark.model
def test_two_versions_of_one_adapter_id_never_share(loaded, model, adapter_dirs):
    ids = prompt(loaded, "What does this adapter change?")
    engine = make_engine(model, adapter_dirs, prefix_cache=True, versions={"chat": "chat"})
    before = run(engine, [request("v1", ids, "chat")])
    engine.add_adapter(read_peft_directory("chat", adapter_dirs["chat-v2"], torch.float32))  # new version
    # Residency is by adapter id: the old version's rows must leave the pool before the new ones
    # page in (the prefix cache's keys carry the content hash; residency does not).
    engine.residency.evict("chat")
    assert (
        engine.host_adapters["chat"].content_sha256
        != read_peft_directory("chat", adapter_dirs["chat"], torch.float32).content_sha256
    )
    after = run(engine, [request("v2", ids, "chat")])
    assert engine.prefix_cache.stats().hit_blocks == 0
    plain = make_engine(model, adapter_dirs, prefix_cache=False, versions={"chat": "chat-v2"})
    assert after == run(plain, [request("v2", ids, "chat")])
    assert after["v2"] != before["v1"]
    assert_no_references_left(engine)


@pytest.mark.model
@pytest.mark.skipif(not invariant_available(), reason="no native batch-invariant kernels")
def test_deterministic_serving_gives_the_same_bits_with_cached_prefixes(loaded, model, adapter_dirs):
    requests = [[request(f"r{i}", prompt(loaded, q), "chat")] for i, q in enumerate(["Who?", "Where?"])]
    logits: dict[str, dict[str, list[torch.Tensor]]] = {}
    tokens = {}
    for cached in (False, True):
        engine = make_engine(model, adapter_dirs, prefix_cache=cached, deterministic=True)
        rows = logits.setdefault(str(cached), {})
        engine.on_logits = lambda rid, row, rows=rows: rows.setdefault(rid, []).append(row.clone())
        tokens[cached] = {k: v for batch in requests for k, v in run(engine, batch).items()}
    assert engine.prefix_cache.stats().hit_blocks > 0
    assert tokens[True] == tokens[False]
    for rid, rows in logits["True"].items():
        assert all(torch.equal(a, b) for a, b in zip(rows, logits["False"][rid], strict=True)), rid


def test_pool_pressure_evicts_cached_blocks_before_preempting(tiny_llama):
    tiny = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(tiny, EngineConfig(pool_mib=0.25, kv_block_tokens=4, max_running=4))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    blocks = engine.pool.layout.num_pages // engine.pool.layout.num_layers

    def prompt_of(i: int, length: int) -> tuple[int, ...]:
        return tuple((11 * i + 5 * j) % 250 + 1 for j in range(length))

    # Distinct prompts, one after another: their blocks stay cached until the pool is full of them.
    for i in range(blocks // 2):
        run(engine, [GenerationRequest(f"fill{i}", prompt_of(i, 15), sampling)])
    filled = engine.prefix_cache.stats()
    assert filled.evicted_blocks > 0 and engine.scheduler.preemptions == 0
    # Two requests that need half the pool each run side by side: room comes from cached blocks.
    big = [GenerationRequest(f"big{i}", prompt_of(100 + i, blocks * 2 - 8), sampling) for i in range(2)]
    run(engine, big)
    assert engine.scheduler.preemptions == 0
    assert engine.prefix_cache.stats().evicted_blocks > filled.evicted_blocks
    assert_no_references_left(engine)
