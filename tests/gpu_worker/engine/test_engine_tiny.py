"""Engine behaviour on a tiny random Llama: exactness against HF + peft, the unified pool under
pressure (LRU eviction of idle adapters, preemption by recompute), and cancellation hygiene."""

from __future__ import annotations

import random

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.peft_format import LORA_TARGETS

SAMPLES = {
    "a8": SampleAdapterSpec(rank=8, scale=0.2, seed=1),
    "a16": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=2),
    "a4-rs": SampleAdapterSpec(
        rank=4, use_rslora=True, target_modules=("q_proj", "down_proj"), scale=0.2, seed=3
    ),
    "a8-pat": SampleAdapterSpec(
        rank=8, rank_pattern={"up_proj": 2}, target_modules=LORA_TARGETS, scale=0.2, seed=4
    ),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {name: write_peft_adapter(root / name, tiny_llama.spec, s) for name, s in SAMPLES.items()}


def make_engine(tiny_llama, adapter_dirs, pool_mib: float = 4, **kwargs) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=pool_mib, kv_block_tokens=4, **kwargs))
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    return engine


def run_all(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list]:
    events: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request, lambda e: events[e.request_id].append(e))
    while engine.has_work():
        engine.step()
    return events


def greedy(i: int, adapter: str | None, prompt_len: int, max_tokens: int = 12) -> GenerationRequest:
    prompt = tuple((7 * i + 3 * j) % 250 + 1 for j in range(prompt_len))
    return GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter)


def test_logits_match_hf_and_peft(tiny_llama, adapter_dirs):
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    logits: dict[str, list[torch.Tensor]] = {}
    engine = make_engine(tiny_llama, adapter_dirs)
    engine.on_logits = lambda rid, row: logits.setdefault(rid, []).append(row.clone())
    adapters = [None, "a8", "a16", "a4-rs", "a8-pat", "a16"]
    requests = [greedy(i, a, 3 + 5 * i) for i, a in enumerate(adapters)]
    events = run_all(engine, requests)
    for request in requests:
        tokens = [e.token_id for e in events[request.request_id]]
        base = LlamaForCausalLM(LlamaConfig(**tiny_llama.hf_config))
        base.load_state_dict(tiny_llama.weights)
        model = (
            base
            if request.adapter_id is None
            else PeftModel.from_pretrained(base, str(adapter_dirs[request.adapter_id]))
        )
        with torch.no_grad():
            ids = torch.tensor([list(request.prompt_ids) + tokens[:-1]])
            reference = model(ids).logits[0, len(request.prompt_ids) - 1 :].float()
        ours = torch.stack(logits[request.request_id])
        assert (ours - reference).abs().max() < 1e-4, request
        assert tokens == reference.argmax(-1).tolist()


def test_pool_pressure_evicts_idle_adapters_preempts_and_gives_the_same_output(tiny_llama, adapter_dirs):
    requests = [
        greedy(i, ["a8", "a16", None, "a4-rs", "a8-pat"][i % 5], 4 + (i * 7) % 23, 16) for i in range(20)
    ]
    roomy = make_engine(tiny_llama, adapter_dirs, pool_mib=8)
    expected = {rid: [e.token_id for e in evs] for rid, evs in run_all(roomy, requests).items()}
    assert roomy.preemptions == 0

    tight = make_engine(tiny_llama, adapter_dirs, pool_mib=0.3, max_running=16)
    got = run_all(tight, requests)
    assert {rid: [e.token_id for e in evs] for rid, evs in got.items()} == expected
    assert tight.preemptions > 0, "the tight pool should have forced preemptions"
    assert all(evs[-1].finish_reason is FinishReason.LENGTH for evs in got.values())
    usage = tight.stats()  # unused cached prefix blocks count as free
    assert usage.kv_pages == 0 and usage.free_pages + usage.adapter_pages == usage.total_pages


def test_idle_adapters_are_evicted_lru(tiny_llama, adapter_dirs):
    # Without the prefix cache: its unused blocks would make the room before any adapter goes.
    engine = make_engine(tiny_llama, adapter_dirs, pool_mib=8, prefix_cache=False)
    for name in ["a8", "a16", "a4-rs"]:
        run_all(engine, [greedy(0, name, 5, 2)])
    assert engine.residency.ids() == ["a8", "a16", "a4-rs"]
    run_all(engine, [greedy(1, "a8", 5, 2)])  # a8 is used again: a16 is now the least recent
    needed = engine.residency.pages_needed(engine.host_adapters["a8-pat"])
    engine.pool.allocate(engine.pool.usage().free_pages - needed + 1, PageUse.KV)
    engine.residency.load(engine.host_adapters["a8-pat"])
    assert engine.residency.ids() == ["a4-rs", "a8", "a8-pat"]


def test_thousand_requests_with_random_cancellations_free_every_page(tiny_llama, adapter_dirs):
    rng = random.Random(0)
    engine = make_engine(tiny_llama, adapter_dirs, pool_mib=1, max_running=32)
    finished: dict[str, FinishReason] = {}

    def sink(event):
        if event.finish_reason is not None:
            finished[event.request_id] = event.finish_reason

    submitted = 0
    names = [None, *SAMPLES]
    while submitted < 1000 or engine.has_work():
        for _ in range(rng.randint(0, 12)):
            if submitted < 1000:
                request = greedy(submitted, rng.choice(names), rng.randint(1, 30), rng.randint(1, 8))
                engine.submit(request, sink)
                submitted += 1
        for _ in range(rng.randint(0, 3)):  # mostly requests still queued or running
            engine.cancel(f"r{rng.randrange(max(submitted - 40, 0), max(submitted, 1))}")
        engine.step()
    assert len(finished) == 1000
    assert sum(r is FinishReason.CANCELLED for r in finished.values()) > 50
    usage = engine.stats()  # unused cached prefix blocks count as free
    assert usage.kv_pages == 0 and not engine.running and not engine.waiting
    assert all(engine.residency.get(a).refcount == 0 for a in engine.residency.ids())
    engine.residency.make_room(usage.total_pages)
    assert engine.pool.usage().free_pages == usage.total_pages


def test_split_pool_gives_the_same_output_as_the_unified_pool(tiny_llama, adapter_dirs):
    requests = [greedy(i, ["a8", "a16", None, "a4-rs"][i % 4], 4 + (i * 5) % 19, 10) for i in range(12)]
    unified = make_engine(tiny_llama, adapter_dirs, pool_mib=1)
    expected = {rid: [e.token_id for e in evs] for rid, evs in run_all(unified, requests).items()}
    split = make_engine(tiny_llama, adapter_dirs, pool_mib=1, adapter_region_share=0.5)
    got = run_all(split, requests)
    assert {rid: [e.token_id for e in evs] for rid, evs in got.items()} == expected
    usage = split.stats()
    kv_region = usage.total_pages - round(usage.total_pages * 0.5)
    cached = split.prefix_cache.evictable_pages()  # unused cached prefix blocks, in the KV region
    assert usage.kv_pages == 0 and split.pool.allocator.free_pages_for(PageUse.KV) + cached == kv_region


def test_a_waiting_request_whose_adapter_was_removed_ends_cancelled(tiny_llama, adapter_dirs):
    engine = make_engine(tiny_llama, adapter_dirs, pool_mib=4)
    events: list = []
    engine.submit(greedy(0, "a8", 5, 3), events.append)
    engine.remove_adapter("a8")
    engine.submit(greedy(1, None, 5, 3), events.append)
    while engine.has_work():
        engine.step()
    finished = {e.request_id: e.finish_reason for e in events if e.finish_reason is not None}
    assert finished == {"r0": FinishReason.CANCELLED, "r1": FinishReason.LENGTH}
    assert not engine.has_adapter("a8")
