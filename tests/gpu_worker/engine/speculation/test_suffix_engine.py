"""``speculative: suffix`` in the engine: a request drafts from the finished outputs of earlier
requests of its adapter in its tenant namespace (never another namespace's), stays token for token
what ``off`` gives, and its adapter's indexes go when the adapter is removed; a request that opts
out (``no_speculation``) drafts nothing (tiny Llama, fp32)."""

from __future__ import annotations

import dataclasses

import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from tests.support.draft_cost import pin_draft_cost

PROMPT = tuple((11 * j * j + 5 * j) % 241 + 3 for j in range(14))
SAMPLING = SamplingParams(max_tokens=24, ignore_eos=True)


def make_engine(tiny_llama, adapter_dir, speculative: str) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, speculative=speculative))
    pin_draft_cost(engine)
    engine.add_adapter(read_peft_directory("a8", adapter_dir, torch.float32))
    return engine


def run_alone(
    engine: Engine,
    request_id: str,
    namespace: str,
    adapter: str | None = "a8",
    sampling: SamplingParams = SAMPLING,
) -> tuple[list[int], int]:
    """The request's tokens and the engine steps it took, run alone."""
    tokens: list[int] = []
    request = GenerationRequest(request_id, PROMPT, sampling, adapter, prefix_cache_namespace=namespace)
    engine.submit(request, lambda e: e.token_id is None or tokens.append(e.token_id))
    first_step = engine.steps
    while engine.has_work():
        engine.step()
    return tokens, engine.steps - first_step


def test_drafts_come_from_the_same_adapter_and_tenant_only_and_go_with_the_adapter(tiny_llama, tmp_path):
    adapter_dir = write_peft_adapter(
        tmp_path / "a8", tiny_llama.spec, SampleAdapterSpec(rank=8, scale=0.2, seed=1)
    )
    expected, plain_steps = run_alone(make_engine(tiny_llama, adapter_dir, "off"), "plain", "tenant:a")

    engine = make_engine(tiny_llama, adapter_dir, "suffix")
    first, first_steps = run_alone(engine, "a-1", "tenant:a")
    again, again_steps = run_alone(engine, "a-2", "tenant:a")
    other_tenant, other_steps = run_alone(engine, "b-1", "tenant:b")
    assert first == again == other_tenant == expected
    # The second request of tenant a drafts its whole output from the first one's; tenant b's
    # request has only its own tokens to draft from, as the first had.
    assert again_steps < first_steps <= plain_steps
    assert other_steps == first_steps
    assert set(engine.speculator.indexes.keys()) == {("a8", "tenant:a"), ("a8", "tenant:b")}

    engine.remove_adapter("a8")
    run_alone(engine, "base", "tenant:a", adapter=None)  # a step: the indexes are looked at before it
    assert engine.speculator.indexes.keys() == [(None, "tenant:a")]


def test_a_request_that_opts_out_drafts_nothing(tiny_llama, tmp_path):
    adapter_dir = write_peft_adapter(
        tmp_path / "a8", tiny_llama.spec, SampleAdapterSpec(rank=8, scale=0.2, seed=1)
    )
    engine = make_engine(tiny_llama, adapter_dir, "suffix")
    opted_out = dataclasses.replace(SAMPLING, no_speculation=True)
    tokens, steps = run_alone(engine, "out-1", "tenant:a", sampling=opted_out)
    run_alone(engine, "out-2", "tenant:a", sampling=opted_out)
    assert steps == len(tokens)  # one token a step
    assert sum(engine.speculator.counts.drafted.values()) == 0
    again, again_steps = run_alone(engine, "in", "tenant:a")
    assert again == tokens
    assert again_steps <= steps


def test_a_wide_batch_drafts_within_the_step_row_cap(tiny_llama, tmp_path):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    config = EngineConfig(pool_mib=4, kv_block_tokens=4, speculative="ngram", max_running=8)
    engine = local_engine(model, config)
    pin_draft_cost(engine)
    engine.speculator.settings = dataclasses.replace(engine.speculator.settings, max_step_rows=10)
    widths: list[int] = []
    draft = engine.speculator.draft

    def counted(batch):
        rows = draft(batch)
        widths.append(sum(1 for r in batch if r.new_tokens == 1) + rows)
        return rows

    engine.speculator.draft = counted
    for i in range(6):
        prompt = tuple((i + j % 5) * 7 % 250 + 1 for j in range(12))  # a period of 5: drafts accepted
        engine.submit(GenerationRequest(f"r{i}", prompt, SAMPLING), lambda e: None)
    while engine.has_work():
        engine.step()
    assert max(widths) == 10  # 6 decode rows and 4 drafts at most
    assert sum(engine.speculator.counts.accepted.values()) > 0
