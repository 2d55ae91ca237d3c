"""Adapter page-in off the step's critical path (issue 30): while an adapter's rows are being
copied into the pool, the running batch steps on and only the adapter's own request waits.

The copy of one adapter is held on an Event inside the executor's ``load_adapter`` (what the
copier thread runs), so "the copy is under way" is a fact of the test, not a race with the
machine's speed; no timing is asserted.
"""

from __future__ import annotations

import threading

import pytest
import torch
from support.polling import HANG_GUARD_S

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.engine import adapter_pager
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.executor.local import LocalExecutor
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.peft_format import LORA_TARGETS

CONFIG = EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=2)


class HeldCopies(LocalExecutor):
    """A local executor whose copy of adapter ``held`` waits until :attr:`release` is set (or
    fails, with ``fail``)."""

    def __init__(self, model: LlamaModel, held: str, fail: bool = False):
        super().__init__(model, CONFIG)
        self.held, self.fail = held, fail
        self.copying = threading.Event()
        self.release = threading.Event()

    def load_adapter(self, adapter, resident) -> None:
        if adapter.adapter_id == self.held:
            self.copying.set()
            assert self.release.wait(HANG_GUARD_S), "the test never released the copy"
            if self.fail:
                raise RuntimeError("the device refused the copy")
        super().load_adapter(adapter, resident)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("page-in-adapters")
    specs = {"a": SampleAdapterSpec(rank=8, scale=0.2, seed=1), "b": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.2, seed=2), "c": SampleAdapterSpec(rank=4, seed=3)}  # fmt: skip
    return {
        name: read_peft_directory(name, write_peft_adapter(root / name, tiny_llama.spec, spec), torch.float32)
        for name, spec in specs.items()
    }


def make_engine(tiny_llama, adapters, executor: LocalExecutor | None = None) -> Engine:
    executor = executor or LocalExecutor(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), CONFIG
    )
    engine = Engine(executor, CONFIG)
    for adapter in adapters.values():
        engine.add_adapter(adapter)
    return engine


def request(request_id: str, adapter: str, max_tokens: int) -> GenerationRequest:
    prompt = tuple(range(3, 12)) if adapter == "a" else tuple(range(20, 27))
    return GenerationRequest(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter
    )


def tokens_alone(engine: Engine, one: GenerationRequest) -> list[int]:
    out: list[int] = []
    engine.submit(one, lambda e: out.append(e.token_id) if e.token_id is not None else None)
    while engine.has_work():
        engine.step()
    return out


def test_the_batch_steps_while_an_adapters_copy_is_held(tiny_llama, adapters):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    executor = HeldCopies(model, held="b")
    engine = make_engine(tiny_llama, adapters, executor)
    events: dict[str, list[int]] = {"run": [], "cold": [], "warm": []}

    def sink(event) -> None:
        if event.token_id is not None:
            events[event.request_id].append(event.token_id)

    try:
        engine.submit(request("run", "a", max_tokens=40), sink)
        assert engine.step() == 1  # an idle engine waits for a's copy: nobody else would wait
        engine.submit(request("cold", "b", max_tokens=5), sink)
        engine.submit(request("warm", "a", max_tokens=5), sink)
        steps = engine.steps
        assert engine.step() == 1  # b's pages are reserved, its copy starts; "run" steps on
        assert executor.copying.wait(HANG_GUARD_S)
        for _ in range(3):
            assert engine.step() == 1
        # The batch advanced while b's copy was held; b's request waits with its slot kept (so
        # the later request, whose adapter is resident, does not take it: max_running is 2).
        assert engine.steps == steps + 4 and len(events["run"]) == 5
        assert "b" in engine.residency and not engine.adapters.ready("b")
        assert engine.stats().running_adapters == ("a",) and events["cold"] == events["warm"] == []
        executor.release.set()
        while not events["cold"]:
            assert engine.step() >= 1
    finally:
        executor.release.set()
    while engine.has_work():
        engine.step()
    # The rows the copier wrote are b's: the same tokens as on an engine that never held a copy.
    reference = make_engine(tiny_llama, adapters)
    assert events["cold"] == tokens_alone(reference, request("cold", "b", max_tokens=5))
    assert len(events["run"]) == 40 and len(events["warm"]) == 5
    engine.stop()


def test_a_failed_copy_gives_its_pages_back(tiny_llama, adapters):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    executor = HeldCopies(model, held="b", fail=True)
    engine = make_engine(tiny_llama, adapters, executor)
    free = engine.pool.usage().free_pages
    engine.preload("b")
    engine.step()  # b's pages are reserved and its copy starts
    assert "b" in engine.residency and engine.pool.usage().free_pages < free
    executor.release.set()
    engine.adapters.copier.close()  # the copy has ended (failed)
    with pytest.raises(RuntimeError, match="refused the copy"):
        engine.step()  # a copy that fails fails the step, as a synchronous one did
    assert "b" not in engine.residency and engine.pool.usage().free_pages == free


def test_memory_tokens_does_not_walk_the_adapters(tiny_llama, adapters, monkeypatch):
    engine = make_engine(tiny_llama, adapters)
    layout = engine.pool.layout
    expected = {
        name: engine.residency.pages_needed(adapter) * layout.kv_block_tokens // layout.num_layers
        for name, adapter in adapters.items()
    }

    def walk(_adapter):
        raise AssertionError("memory_tokens walked an adapter's rows")

    monkeypatch.setattr(engine.residency, "pages_needed", walk)
    assert engine.memory_tokens().adapter_tokens == expected  # footprints kept since add_adapter
    engine.remove_adapter("a")
    del expected["a"]
    assert engine.memory_tokens().adapter_tokens == expected


def test_a_burst_of_preloads_beside_a_batch_is_spread_over_steps(tiny_llama, adapters, monkeypatch):
    monkeypatch.setattr(adapter_pager, "PAGE_IN_STEP_SHARE", 0.0)  # one page-in per step, exactly
    engine = make_engine(tiny_llama, adapters)
    engine.submit(request("run", "a", max_tokens=10), lambda event: None)
    engine.step()
    engine.preload("b")
    engine.preload("c")
    assert engine.step() == 1
    assert ["b" in engine.residency, "c" in engine.residency] == [True, False]
    assert engine.step() == 1
    assert "c" in engine.residency
    engine.stop()


def test_an_idle_engine_copies_the_adapter_it_waits_for_itself(tiny_llama, adapters):
    """With no batch running the copy overlaps nothing: the engine's thread makes it, rather than
    wait on the copier thread, which gives way to the engine's spinning OpenMP team."""
    engine = make_engine(tiny_llama, adapters)
    copier_threads: list[str] = []
    load_adapter = engine.executor.load_adapter

    def seen(adapter, resident) -> None:
        copier_threads.append(threading.current_thread().name)
        load_adapter(adapter, resident)

    engine.adapters.copier._write = seen
    out: list[int] = []
    engine.submit(
        request("cold", "b", max_tokens=3),
        lambda e: out.append(e.token_id) if e.token_id is not None else None,
    )
    engine.step()  # the prefill: b paged in, then run, in this one step
    assert copier_threads == [threading.current_thread().name] and len(out) == 1
    engine.preload("c")  # a preload, with nothing waiting on it: the copier thread's
    engine.step()
    engine.adapters.wait("c")
    assert copier_threads[1].startswith("loramesh-page-in")
    while engine.has_work():
        engine.step()
    assert out == tokens_alone(make_engine(tiny_llama, adapters), request("cold", "b", max_tokens=3))
    engine.stop()
