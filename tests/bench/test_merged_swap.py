"""The merged-swap system gives the engine's own LoRA outputs, leaves the base weights exactly as
they were, switches adapters as its policy says, and stops at the window."""

from __future__ import annotations

import pytest
import torch
from support.tiny_hf_model import SPEC

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from bench.systems.base import AdapterSet, RunContext
from bench.systems.clock import TickClock
from bench.systems.merged_swap import MergedSwapOptions, MergedSwapSystem
from bench.workload import TraceRequest
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.merged_weights import MergedWeights
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

# Adapter 2 also adapts the MLP, so every fused matrix (qkv, o, gate_up, down) gets merged into.
ADAPTERS = [
    SampleAdapterSpec(rank=8, seed=0, scale=0.05),
    SampleAdapterSpec(rank=16, seed=1, scale=0.05),
    SampleAdapterSpec(rank=8, seed=2, scale=0.05, target_modules=LORA_TARGETS),
]
FUSED = ("qkv", "o", "gate_up", "down")

# Virtual time (bench/systems/clock.py): 10 ms per clock read, so whether a request finishes
# inside the window depends on the replay's code path, never on this machine's speed.
TICK_S = 0.01

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> AdapterSet:
    root = tmp_path_factory.mktemp("adapters")
    for index, sample in enumerate(ADAPTERS):
        write_peft_adapter(root / AdapterSet.name(index), SPEC, sample)
    return AdapterSet(root, tuple(a.rank for a in ADAPTERS))


def request(index: int, adapter: int, time_s: float = 0.0, input_len: int = 12, output_len: int = 6):
    return TraceRequest(time_s, adapter, ADAPTERS[adapter].rank, input_len, output_len, f"req-{index:06d}")


def fresh_model(model_dir) -> LlamaModel:
    loaded = load_model(model_dir)
    return LlamaModel(loaded.config, loaded.weights, torch.float32)


def engine_tokens(model_dir, adapters: AdapterSet, context: RunContext, lora: bool) -> dict:
    """Every request's greedy tokens from the engine's unmerged LoRA path (``lora``) or the base model."""
    engine = local_engine(fresh_model(model_dir), EngineConfig(pool_mib=8))
    for index in range(adapters.count):
        engine.add_adapter(
            read_peft_directory(adapters.name(index), adapters.directory(index), torch.float32)
        )
    tokens: dict[str, list[int]] = {}
    for t in context.trace:
        engine.submit(
            GenerationRequest(
                t.request_id,
                context.prompt(t),
                SamplingParams(max_tokens=t.output_len, ignore_eos=True),
                adapters.name(t.adapter) if lora else None,
            ),
            lambda event: tokens.setdefault(event.request_id, []).append(event.token_id),
        )
    while engine.has_work():
        engine.step()
    return tokens


def test_outputs_equal_the_engine_s_lora_path_and_base_weights_come_back_bit_identical(model_dir, adapters):
    trace = [
        request(0, 0, 0.00, 12, 6), request(1, 1, 0.01, 5, 4), request(2, 2, 0.02, 20, 7),
        request(3, 0, 0.03, 9, 3), request(4, 1, 0.25, 15, 8), request(5, 2, 0.30, 7, 5),
    ]  # fmt: skip
    progress, samples = [], []
    context = RunContext(
        trace, adapters, window_s=60, model_path=str(model_dir), pool_mib=8,
        on_progress=progress.append, on_sample=lambda t, stats: samples.append(stats), clock=TickClock(TICK_S),
    )  # fmt: skip
    system = MergedSwapSystem()
    records = system.run(context)

    assert [r.request_id for r in records] == [t.request_id for t in trace] and sum(progress) == len(trace)
    for record in records:
        assert record.completed and record.output_tokens == record.output_len
        assert record.arrival_s <= record.first_token_s <= record.finish_s < 60
    assert samples and {"kv_pages", "adapter_pages", "running"} <= samples[0].keys()
    # Token equality: merging changes only the rounding of W·x + s·B·A·x, no near-tie on this model.
    assert system.outputs == engine_tokens(model_dir, adapters, context, lora=True)
    assert system.outputs != engine_tokens(model_dir, adapters, context, lora=False)
    stats = system.stats()
    assert stats["switches"] >= 3 and stats["switch_s"] > 0 and stats["adapter_load_s"] > 0
    pristine = fresh_model(model_dir)
    for served, base in zip(system.model.layers, pristine.layers):
        assert all(torch.equal(getattr(served, name), getattr(base, name)) for name in FUSED)


def test_merge_unmerge_cycles_restore_the_base_bit_for_bit_and_merges_do_not_stack(model_dir, adapters):
    model = fresh_model(model_dir)
    before = [layer.gate_up.clone() for layer in model.layers]
    weights = MergedWeights(model)
    adapter = read_peft_directory("a", adapters.directory(2), torch.float32)
    for _ in range(3):
        weights.merge(adapter)
        assert not torch.equal(model.layers[0].gate_up, before[0])
        weights.unmerge()
    assert all(torch.equal(layer.gate_up, b) for layer, b in zip(model.layers, before))
    with pytest.raises(RuntimeError):
        weights.merge(adapter)
        weights.merge(adapter)


@pytest.mark.parametrize(("switch_after_s", "switches"), [(60.0, 2), (0.0, 3)])
def test_the_current_adapter_keeps_admitting_until_another_request_waited_too_long(
    model_dir, adapters, switch_after_s, switches
):
    # All waiting at once, 2 slots. Adapter 0 goes first (oldest) with requests 0 and 2. Patient:
    # request 3 takes a freed slot, then adapter 1: 2 merges. Impatient (request 1 has already
    # waited > 0 s): adapter 0 stops admitting, adapter 1 runs, then adapter 0 again: 3 merges.
    trace = [request(0, 0), request(1, 1), request(2, 0, output_len=3), request(3, 0)]
    context = RunContext(
        trace,
        adapters,
        window_s=60,
        model_path=str(model_dir),
        max_batch=2,
        pool_mib=8,
        clock=TickClock(TICK_S),
    )
    system = MergedSwapSystem(MergedSwapOptions(switch_after_s=switch_after_s))
    records = system.run(context)
    assert all(r.completed for r in records) and system.switches == switches
    served_before_adapter_1 = records[3].first_token_s < records[1].first_token_s
    assert served_before_adapter_1 == (switch_after_s > 0)


def test_requests_unfinished_at_the_window_have_no_finish_time(model_dir, adapters):
    trace = [request(0, 0, output_len=400), request(1, 1, time_s=0.1)]
    progress = []
    context = RunContext(
        trace,
        adapters,
        window_s=0.5,
        model_path=str(model_dir),
        pool_mib=8,
        on_progress=progress.append,
        clock=TickClock(TICK_S),
    )
    system = MergedSwapSystem()
    records = system.run(context)
    assert records[0].finish_s is None and 0 < records[0].output_tokens < 400
    assert records[1].finish_s is None and records[1].output_tokens == 0  # adapter 0 keeps the engine
    assert sum(progress) == 2 and system.model.layers[0].qkv.equal(fresh_model(model_dir).layers[0].qkv)
