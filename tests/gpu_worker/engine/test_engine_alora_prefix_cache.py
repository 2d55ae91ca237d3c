"""An activated LoRA's prompt before its invocation is base-model KV, and the prefix cache shares
it as such.

SmolLM2-135M in fp32, 16-token blocks. A base request's cached prompt is reused by the requests
of two aLoRA adapters (different invocations) that continue it with their invocation: each skips
the prefill of every block wholly before its invocation, and its tokens and logits equal a
cache-free engine's. A standard adapter's request with the same prompt reuses nothing (its KV
differs in every block), nor does an aLoRA request of another tenant (namespaces as cache_salt).
Then the other way round: a base request reuses the blocks an aLoRA request computed before
its invocation, and its output equals a cache-free run's.
"""

from __future__ import annotations

import pytest
import torch
from support.alora_adapters import write_adapters

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.model

NEW_TOKENS = 4
BLOCK = 16
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, name your sources, and never make "
    "up facts. If a question is ambiguous, say which reading you answer. The Eiffel Tower is in "
    "Paris and was finished in 1889 for the World's Fair."
)
ADAPTERS = {
    "check": (SampleAdapterSpec(rank=8, scale=0.05, seed=51), " Is this correct?"),
    "grade": (SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.03, seed=52), " Grade:"),
    "sql": (SampleAdapterSpec(rank=8, scale=0.05, seed=53), None),
}
"""Name -> (weights, invocation text; None: a standard LoRA)."""


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def model(loaded):
    return LlamaModel(loaded.config, loaded.weights, torch.float32)


@pytest.fixture(scope="module")
def written(loaded, base_spec, tmp_path_factory):
    """Each aLoRA's invocation tokens, and each adapter's directory."""
    return write_adapters(
        tmp_path_factory.mktemp("alora-prefix-adapters"), base_spec, loaded.tokenizer, ADAPTERS
    )


@pytest.fixture(scope="module")
def invocations(written) -> dict[str, list[int]]:
    return written[0]


@pytest.fixture(scope="module")
def adapter_dirs(written):
    return written[1]


def make_engine(model, adapter_dirs, prefix_cache: bool) -> Engine:
    engine = local_engine(model, EngineConfig(pool_mib=64, kv_block_tokens=BLOCK, prefix_cache=prefix_cache))
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    return engine


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], int, list]]:
    """Each request's greedy tokens, cached prompt tokens and logits, run together."""
    out: dict[str, tuple[list[int], list[int], list]] = {r.request_id: ([], [0], []) for r in requests}
    engine.on_logits = lambda rid, row: out[rid][2].append(row.clone())

    def sink(event) -> None:
        if event.token_id is not None:
            out[event.request_id][0].append(event.token_id)
        out[event.request_id][1][0] = event.cached_prompt_tokens

    for request in requests:
        engine.submit(request, sink)
    while engine.has_work():
        engine.step()
    return {rid: (tokens, cached[0], logits) for rid, (tokens, cached, logits) in out.items()}


def request(
    rid: str, prompt: list[int], adapter: str | None, namespace: str = "tenant:a"
) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return GenerationRequest(rid, tuple(prompt), sampling, adapter, prefix_cache_namespace=namespace)


def assert_same(ours, theirs, rid: str) -> None:
    assert ours[0] == theirs[0], f"{rid}: {ours[0]} with the cache, {theirs[0]} without"
    for step, (a, b) in enumerate(zip(ours[2], theirs[2], strict=True)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-3, f"{rid} step {step}: logits differ from a cache-free run by {diff:.2e}"


def test_a_base_prompt_is_reused_by_alora_requests(loaded, model, adapter_dirs, invocations):
    system = loaded.tokenizer.encode(SYSTEM)
    shared = len(system) // BLOCK * BLOCK
    assert shared >= 2 * BLOCK
    tail = loaded.tokenizer.encode(" Answer yes or no.")
    followers = [
        request("check", system + invocations["check"] + tail, "check"),
        request("grade", system + invocations["grade"], "grade"),
        request("sql", system + invocations["check"] + tail, "sql"),
        request("check-b", system + invocations["check"] + tail, "check", namespace="tenant:b"),
    ]
    engine = make_engine(model, adapter_dirs, prefix_cache=True)
    first = run(engine, [request("base", system, None)])
    after = run(engine, followers)
    assert first["base"][1] == 0
    assert {rid: got[1] for rid, got in after.items()} == {
        "check": shared,
        "grade": shared,
        "sql": 0,
        "check-b": 0,
    }

    fresh = run(
        make_engine(model, adapter_dirs, prefix_cache=False), [request("base", system, None), *followers]
    )
    for rid, got in after.items():
        assert_same(got, fresh[rid], rid)


def test_an_alora_request_computes_base_blocks_for_base_requests(loaded, model, adapter_dirs, invocations):
    system = loaded.tokenizer.encode(SYSTEM)
    shared = len(system) // BLOCK * BLOCK
    checked = request("check", system + invocations["check"], "check")
    base = request("base", system + loaded.tokenizer.encode(" Thank you."), None)
    engine = make_engine(model, adapter_dirs, prefix_cache=True)
    run(engine, [checked])
    after = run(engine, [base])
    assert after["base"][1] == shared
    fresh = run(make_engine(model, adapter_dirs, prefix_cache=False), [base])
    assert_same(after["base"], fresh["base"], "base")
