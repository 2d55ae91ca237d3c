"""Migration on the engine (tiny random Llama): a request handed off mid-generation ends with
MIGRATED after every token it emitted, frees its pages, and, resumed elsewhere as prompt + tokens
so far, finishes with the greedy output of a run that never moved."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import NotFound

PROMPT = (5, 17, 3, 42, 8, 9)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def new_engine(tiny_llama, max_running: int = 4) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    # Tokens are counted in steps: one a step, without drafts.
    config = EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=max_running, speculative="off")
    return local_engine(model, config)


def run(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_handed_off_request_resumed_elsewhere_matches_an_unmoved_run(tiny_llama):
    unmoved: list[TokenEvent] = []
    reference = new_engine(tiny_llama)
    reference.submit(GenerationRequest("r", PROMPT, GREEDY), unmoved.append)
    run(reference)
    expected = [e.token_id for e in unmoved if e.token_id is not None]

    source, events = new_engine(tiny_llama), []
    source.submit(GenerationRequest("r.0", PROMPT, GREEDY), events.append)
    for _ in range(7):
        source.step()
    free_before = source.pool.usage().free_pages
    generated = source.between_steps(lambda: source.hand_off("r.0"))
    source.step()  # applies the hand-off between two steps
    assert generated.result(timeout=0) == 7
    assert events[-1].finish_reason is FinishReason.MIGRATED
    assert [e.finish_reason for e in events[:-1]] == [None] * 7
    assert source.pool.usage().free_pages > free_before
    assert not source.has_work()

    so_far = [e.token_id for e in events if e.token_id is not None]
    target, rest = new_engine(tiny_llama), []
    target.submit(
        GenerationRequest("r.1", PROMPT + tuple(so_far), SamplingParams(max_tokens=24 - 7, ignore_eos=True)),
        rest.append,
    )
    run(target)
    assert so_far + [e.token_id for e in rest if e.token_id is not None] == expected


def test_queued_requests_are_listed_and_can_be_handed_off_too(tiny_llama):
    engine, events = new_engine(tiny_llama, max_running=1), []
    engine.submit(GenerationRequest("running", PROMPT, GREEDY), events.append)
    engine.submit(GenerationRequest("queued", PROMPT, GREEDY), events.append)
    engine.step()
    future = engine.between_steps(engine.list_requests)
    assert not future.done()  # the listing runs on the engine thread, between two steps
    engine.step()
    listed = {s.request_id: s for s in future.result(timeout=0)}
    assert listed["running"].running and not listed["queued"].running
    assert listed["running"].context_tokens == len(PROMPT) + 1  # listed before the second step
    assert listed["running"].remaining_tokens == 24 - 1
    assert listed["queued"].context_tokens == len(PROMPT)

    handed = engine.between_steps(lambda: engine.hand_off("queued"))
    engine.step()
    assert handed.result(timeout=0) == 0
    assert [e for e in events if e.request_id == "queued"][-1].finish_reason is FinishReason.MIGRATED


def test_handing_off_an_unknown_or_finished_request_is_not_found(tiny_llama):
    engine = new_engine(tiny_llama)
    engine.submit(GenerationRequest("done", PROMPT, SamplingParams(max_tokens=1)), lambda e: None)
    run(engine)
    for request_id in ("done", "never-here"):
        future = engine.between_steps(lambda r=request_id: engine.hand_off(r))
        engine.step()
        with pytest.raises(NotFound, match=request_id):
            future.result(timeout=0)
