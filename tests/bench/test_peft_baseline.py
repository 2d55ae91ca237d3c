"""The PEFT baseline serves a trace with peft's own outputs, FCFS batches of one adapter, and stops
at the window."""

from __future__ import annotations

import pytest
import torch
from support.tiny_hf_model import SPEC

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.systems.base import AdapterSet, RunContext
from bench.systems.clock import TickClock
from bench.systems.peft_baseline import PeftBaselineSystem
from bench.workload import TraceRequest

RANKS = (8, 16, 8)  # adapters 0 and 2 share a configuration, so one swaps the other's weights in

# Virtual time (bench/systems/clock.py): 10 ms per clock read, so whether a request finishes
# inside the window depends on the replay's code path, never on this machine's speed.
TICK_S = 0.01

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> AdapterSet:
    root = tmp_path_factory.mktemp("adapters")
    for index, rank in enumerate(RANKS):
        # Larger weights than the default so each adapter visibly changes the tiny model's tokens.
        write_peft_adapter(
            root / AdapterSet.name(index), SPEC, SampleAdapterSpec(rank=rank, seed=index, scale=0.05)
        )
    return AdapterSet(root, RANKS)


def request(index: int, adapter: int, time_s: float = 0.0, input_len: int = 12, output_len: int = 6):
    return TraceRequest(time_s, adapter, RANKS[adapter], input_len, output_len, f"req-{index:06d}")


def peft_greedy(model_dir, adapters: AdapterSet, trace: list[TraceRequest], context: RunContext) -> dict:
    """peft's own single-request greedy output of each request (EOS suppressed, as the baseline)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    outputs = {}
    for adapter in sorted({t.adapter for t in trace}):
        base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapters.directory(adapter))).eval()
        for t in (t for t in trace if t.adapter == adapter):
            ids = torch.tensor([context.prompt(t)])
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=t.output_len,
                    min_new_tokens=t.output_len, do_sample=False, pad_token_id=0,
                )  # fmt: skip
            outputs[t.request_id] = out[0, ids.shape[1] :].tolist()
    return outputs


def test_every_request_completes_with_peft_s_own_greedy_tokens(model_dir, adapters):
    trace = [
        request(0, 0, 0.00, 12, 6), request(1, 1, 0.01, 5, 4), request(2, 2, 0.02, 20, 7),
        request(3, 0, 0.03, 9, 3), request(4, 1, 0.25, 15, 8), request(5, 2, 0.30, 7, 5),
    ]  # fmt: skip
    progress = []
    context = RunContext(
        trace,
        adapters,
        window_s=60,
        model_path=str(model_dir),
        on_progress=progress.append,
        clock=TickClock(TICK_S),
    )
    system = PeftBaselineSystem()
    records = system.run(context)

    assert [r.request_id for r in records] == [t.request_id for t in trace] and sum(progress) == len(trace)
    for record in records:
        assert record.completed and record.output_tokens == record.output_len
        assert record.arrival_s <= record.first_token_s <= record.finish_s < 60
        assert len(system.outputs[record.request_id]) == record.output_len
    assert system.outputs == peft_greedy(model_dir, adapters, trace, context)
    # Adapter 2 reuses adapter 0's slot: its weights were swapped in (and back) at least once.
    assert system.stats()["switches"] >= 2
    assert len({tuple(system.outputs[t.request_id]) for t in trace[:3]}) == 3


def test_fcfs_batches_take_the_oldest_request_s_adapter_up_to_max_batch(model_dir, adapters):
    # All waiting at once: [0, 2] (adapter 0, max_batch 2), then [1] (adapter 1, now the oldest), then [3].
    trace = [request(0, 0), request(1, 1), request(2, 0), request(3, 0)]
    context = RunContext(
        trace, adapters, window_s=60, model_path=str(model_dir), max_batch=2, clock=TickClock(TICK_S)
    )
    first = [r.first_token_s for r in PeftBaselineSystem().run(context)]
    assert first[0] == first[2] < first[1] < first[3]


def test_requests_unfinished_at_the_window_have_no_finish_time(model_dir, adapters):
    trace = [request(0, 0, output_len=400), request(1, 1, time_s=0.1)]
    progress = []
    context = RunContext(
        trace,
        adapters,
        window_s=0.5,
        model_path=str(model_dir),
        on_progress=progress.append,
        clock=TickClock(TICK_S),
    )
    records = PeftBaselineSystem().run(context)
    assert records[0].finish_s is None and 0 < records[0].output_tokens < 400
    assert records[1].finish_s is None and records[1].output_tokens == 0  # queued behind the long batch
    assert sum(progress) == 2
