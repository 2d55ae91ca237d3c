"""Followers rebuild exactly the plan rank 0 runs from the deltas it sends, and a decode step at
batch 32 costs them a small fraction of the whole plan."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.executor.plan_delta import ContinuedRequest, NewRequest, PlanDecoder, PlanEncoder
from services.runtime.sampling.sampling_params import SamplingParams

LAYERS = 30
BLOCK = 16


class Pages:
    def __init__(self) -> None:
        self.next = 0

    def block(self) -> tuple[int, ...]:
        self.next += LAYERS
        return tuple(range(self.next - LAYERS, self.next))


def prefill(request_id: str, prompt: int, pages: Pages, adapter: str | None = None) -> PlannedRequest:
    blocks = tuple(pages.block() for _ in range(-(-prompt // BLOCK)))
    slot = AdapterSlot(adapter, 1) if adapter else None
    return PlannedRequest(request_id, tuple(range(prompt)), 0, blocks, slot, SamplingParams(max_tokens=64))


def decode(request: PlannedRequest, pages: Pages) -> PlannedRequest:
    position = request.end_position
    blocks = request.kv_blocks + ((pages.block(),) if position % BLOCK == 0 else ())
    return replace(request, token_ids=(position % 97,), start_position=position, kv_blocks=blocks)


def plan(requests) -> StepPlan:
    return StepPlan(tuple(requests), "torch", False)


def test_the_decoder_rebuilds_every_plan_through_joins_pauses_preemptions_and_changes():
    rng = random.Random(7)
    pages = Pages()
    encoder, decoder = PlanEncoder(), PlanDecoder()
    live: dict[str, PlannedRequest] = {}
    kinds: set[str] = set()
    for step in range(200):
        for request_id, request in list(live.items()):
            roll = rng.random()
            if roll < 0.03:
                del live[request_id]  # finished
            elif roll < 0.05:  # preempted and recomputed: a new table, from position 0
                live[request_id] = prefill(request_id, request.end_position, pages, "a")
            elif roll < 0.06:  # a new seed: the same table, other sampling
                live[request_id] = replace(decode(request, pages), sampling=SamplingParams(seed=step))
            else:
                live[request_id] = decode(request, pages)
        if rng.random() < 0.3:
            live[f"r{step}"] = prefill(f"r{step}", rng.randint(1, 70), pages, rng.choice([None, "a", "b"]))
        running = [r for r in live.values() if rng.random() > 0.1]  # the rest pause, KV kept
        sent = plan(running)
        delta = encoder.encode(sent)
        kinds.update(type(item).__name__ for item in delta.requests)
        assert decoder.decode(pickle.loads(pickle.dumps(delta))) == sent
    assert kinds == {"NewRequest", "ContinuedRequest"}


def test_a_continuing_request_is_sent_as_its_new_tokens_and_blocks_only():
    pages = Pages()
    encoder = PlanEncoder()
    first = prefill("r", 16, pages)
    assert isinstance(encoder.encode(plan([first])).requests[0], NewRequest)
    second = decode(first, pages)  # position 16 opens a new block
    item = encoder.encode(plan([second])).requests[0]
    assert item == ContinuedRequest(0, second.token_ids, 16, second.kv_blocks[1:])


def test_a_decode_step_at_batch_32_costs_the_followers_at_least_5x_fewer_bytes():
    pages = Pages()
    encoder = PlanEncoder()
    requests = [
        prefill(f"request-{i:04d}-{'x' * 24}", 200 + 7 * i, pages, f"adapter-{i % 8}") for i in range(32)
    ]
    encoder.encode(plan(requests))
    full, delta = [], []
    for _ in range(20):
        requests = [decode(r, pages) for r in requests]
        full.append(len(pickle.dumps(plan(requests), protocol=pickle.HIGHEST_PROTOCOL)))
        delta.append(len(pickle.dumps(encoder.encode(plan(requests)), protocol=pickle.HIGHEST_PROTOCOL)))
    assert sum(full) >= 5 * sum(delta)
