"""Batch policies on the real engine (tiny random Llama, fp32): dLoRA's merged mode gives the
tokens and logits of unmerged LoRA and leaves the base weights bit-identical once unmerged;
switching modes under load never loses or duplicates a token; an early abort finishes the
request with the reason; every policy serves a mixed load to the same tokens as FCFS."""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.policies import BATCH_POLICIES
from services.gpu_worker.engine.policies.batch_policy import UNMERGED, Merged
from services.gpu_worker.engine.policies.dlora import DloraConfig, DynamicBatching
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.peft_format import LORA_TARGETS

ADAPTERS = {
    "a": SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, scale=0.3, seed=11),
    "b": SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj", "down_proj"), scale=0.3, seed=12),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("policy-adapters")
    return {name: write_peft_adapter(root / name, tiny_llama.spec, spec) for name, spec in ADAPTERS.items()}


def make_engine(tiny_llama, adapter_dirs, policy=None, pool_mib: float = 4, **config) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=pool_mib, kv_block_tokens=4, **config), batch_policy=policy
    )
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    return engine


def request(i: int, adapter: str | None, max_tokens: int = 10) -> GenerationRequest:
    prompt = tuple((5 * i + 3 * j) % 250 + 1 for j in range(6 + i % 5))
    return GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter)


def run(
    engine: Engine, requests: list[GenerationRequest], logits: dict | None = None, max_steps: int = 10_000
) -> dict[str, list]:
    """Every event per request; with ``logits``, each step's logits per request too. Fails past
    ``max_steps`` steps (a request the engine never finishes)."""
    if logits is not None:
        engine.on_logits = lambda rid, row: logits.setdefault(rid, []).append(row.float().clone())
    events: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r, lambda e: events[e.request_id].append(e))
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        engine.step()
    raise AssertionError(f"the engine still has work after {max_steps} steps")


def tokens(events: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}


def always_merge() -> DynamicBatching:
    return DynamicBatching(DloraConfig(alpha=0.05, beta=0.05, min_threshold=0.05, merge_must_pay=False))


def fixed_weights(engine: Engine) -> list[torch.Tensor]:
    return [
        t.clone()
        for layer in engine.executor.model.layers
        for t in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]


def test_a_merged_step_gives_the_unmerged_tokens_and_logits_and_unmerging_restores_the_base(
    tiny_llama, adapter_dirs
):
    requests = [request(i, "a") for i in range(3)]
    unmerged_logits: dict = {}
    unmerged = tokens(run(make_engine(tiny_llama, adapter_dirs), requests, unmerged_logits))

    engine = make_engine(tiny_llama, adapter_dirs, always_merge())
    base = fixed_weights(engine)
    merged_logits: dict = {}
    merged = tokens(run(engine, requests, merged_logits))
    assert engine.adapters.mode == Merged("a") and engine.adapters.mode_switches == 1
    assert merged == unmerged
    for rid, rows in unmerged_logits.items():
        for got, want in zip(merged_logits[rid], rows, strict=True):
            assert torch.allclose(got, want, atol=1e-3, rtol=0)

    run(engine, [request(9, None)])  # a base-model request: the policy unmerges
    assert engine.adapters.mode == UNMERGED
    assert all(torch.equal(now, before) for now, before in zip(fixed_weights(engine), base))


def test_switching_under_load_never_loses_or_duplicates_a_token(tiny_llama, adapter_dirs):
    load = [request(i, ("a", "b", None, "a", "a")[i % 5], max_tokens=6 + i % 4) for i in range(15)]
    want = tokens(run(make_engine(tiny_llama, adapter_dirs), load))
    policy = DynamicBatching(
        DloraConfig(alpha=0.3, beta=0.25, period_steps=5, credit_threshold=4, merge_must_pay=False)
    )
    engine = make_engine(tiny_llama, adapter_dirs, policy, max_running=4)
    events = run(engine, load)
    assert tokens(events) == want
    for r in load:
        (last,) = [e for e in events[r.request_id] if e.finish_reason is not None]
        assert last.finish_reason is FinishReason.LENGTH and last.output_len == r.sampling.max_tokens
    assert engine.adapters.mode_switches >= 2 and policy.merged_steps > 0


@pytest.mark.parametrize("name", sorted(BATCH_POLICIES))
def test_every_policy_serves_a_mixed_load_to_the_fcfs_tokens(tiny_llama, adapter_dirs, name):
    load = [request(i, ("a", "b", None)[i % 3]) for i in range(9)]
    want = tokens(run(make_engine(tiny_llama, adapter_dirs), load))
    # Early abort with its 6 s SLO would shed load on a slow machine: here every request is kept.
    policy = EarlyAbort(EarlyAbortConfig(first_token_slo_s=1e9)) if name == "early_abort" else None
    engine = make_engine(tiny_llama, adapter_dirs, policy, batch_policy=name, max_running=3)
    assert tokens(run(engine, load)) == want


def test_an_early_abort_finishes_the_request_with_the_reason(tiny_llama, adapter_dirs):
    # Each step is modelled to take 40 s against a 50 s SLO, and one request runs at a time (its
    # 10 tokens hold the slot for 10 steps): of three requests queued at once only one can make
    # it, so the two older ones are aborted before running (the 10 s of slack only has to cover
    # handing the requests to the engine).
    cost = step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (40.0, 0.0, 0.0, 0.0)))
    policy = EarlyAbort(EarlyAbortConfig(first_token_slo_s=50.0), cost)
    engine = make_engine(tiny_llama, adapter_dirs, policy, max_running=1)
    events = run(engine, [request(i, "a") for i in range(3)])
    finals = {rid: next(e for e in evs if e.finish_reason is not None) for rid, evs in events.items()}
    assert finals["r2"].finish_reason is FinishReason.LENGTH
    for rid in ("r0", "r1"):
        assert finals[rid].finish_reason is FinishReason.ABORTED and "50 s SLO" in finals[rid].error
        assert not [e for e in events[rid] if e.token_id is not None]
    assert engine.scheduler.aborted == 2 and engine.stats().aborted_requests == 2


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="batch_policy must be one of"):
        EngineConfig(batch_policy="sjf")


def test_a_lone_request_that_outgrows_the_whole_pool_ends_at_its_limit_instead_of_waiting(
    tiny_llama, adapter_dirs
):
    # 4 KiB pool: 1 KiB pages of 4 tokens for the tiny model's 2 layers -> 2 blocks = 8 tokens.
    engine = make_engine(tiny_llama, adapter_dirs, pool_mib=1 / 256)
    long_output = GenerationRequest("r", (5, 6, 7), SamplingParams(max_tokens=50, ignore_eos=True), None)
    events = run(engine, [long_output], max_steps=200)
    final = events["r"][-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert 0 < final.output_len < 50 and not engine.waiting and not engine.running


def test_the_early_abort_slo_is_the_engine_configs(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)

    def slo(**config) -> float:
        engine = local_engine(
            model, EngineConfig(pool_mib=1, kv_block_tokens=4, batch_policy="early_abort", **config)
        )
        return engine.policy.config.first_token_slo_s

    assert slo(early_abort_slo_s=2.5) == 2.5  # the worker's --early-abort-slo-s
    assert slo() == EarlyAbortConfig().first_token_slo_s == 6.0
    with pytest.raises(ValueError, match="early_abort_slo_s"):
        EngineConfig(early_abort_slo_s=0)
