"""Admission at the slot cliff (issue 30): a request whose adapter finds no room in the pool
(every resident adapter is held by running requests) waits with its place kept, but does not
stop admission for the requests behind it whose adapters are resident; one held adapter drains
for it, and no other new adapter is paged in ahead of it.

The pool is split (``adapter_region_share``) so that its adapter region holds exactly two of the
rank-8 adapters while the KV has room to spare: "no room" is a fact of the test.
"""

from __future__ import annotations

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.gpu_worker.model.llama import LlamaModel

BASE = EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=16)
RANKS = {"a": 8, "b": 8, "c": 8, "d": 8, "wide": 12}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission-adapters")
    return {
        name: read_peft_directory(
            name,
            write_peft_adapter(root / name, tiny_llama.spec, SampleAdapterSpec(rank=rank, scale=0.2, seed=i)),
            torch.float32,
        )
        for i, (name, rank) in enumerate(RANKS.items())
    }


def two_slot_engine(tiny_llama, adapters) -> Engine:
    """An engine whose pool's adapter region holds exactly two of ``adapters``."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    probe = local_engine(model, BASE)
    probe.add_adapter(adapters["a"])
    probe.preload("a")
    probe.step()
    probe.adapters.settle()
    used = len(probe.residency.get("a").pages)
    upper = probe.residency.pages_needed(adapters["a"])
    pages = probe.pool.layout.num_pages
    probe.stop()
    region = used + upper  # two fit (the second at its upper bound); a third does not
    assert region < 3 * used
    config = EngineConfig(**{**BASE.__dict__, "adapter_region_share": region / pages})
    engine = local_engine(model, config)
    for adapter in adapters.values():
        engine.add_adapter(adapter)
    return engine


def request(request_id: str, adapter: str | None, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id, tuple(range(3, 10)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter
    )


def running_ids(engine: Engine) -> set[str]:
    return {r.request_id for r in engine.running}


def test_requests_of_resident_adapters_pass_one_that_waits_for_adapter_room(tiny_llama, adapters):
    engine = two_slot_engine(tiny_llama, adapters)
    firsts: list[str] = []

    def sink(event) -> None:
        if event.token_id is not None and event.request_id not in firsts:
            firsts.append(event.request_id)

    engine.submit(request("a-long", "a", max_tokens=40), sink)
    engine.submit(request("b-short", "b", max_tokens=6), sink)
    while running_ids(engine) != {"a-long", "b-short"} or not {"a-long", "b-short"} <= set(firsts):
        engine.step()
    assert set(engine.residency.ids()) == {"a", "b"}
    with pytest.raises(PoolExhausted):  # the region is full: both adapters are held
        engine.residency.make_room(engine.residency.pages_needed(adapters["c"]))

    # The oldest queued request needs a third adapter; behind it, requests of held adapters, a
    # base-model request, and a fourth adapter's request.
    for rid, adapter in [("c1", "c"), ("a2", "a"), ("b2", "b"), ("base", None), ("d1", "d"), ("a3", "a")]:
        engine.submit(request(rid, adapter, max_tokens=4), sink)
    engine.step()
    # c1 waits with its place kept; a's and the base model's requests start in the same step;
    # b (its running request ends soonest) drains: it takes no new requests; d is not paged in
    # ahead of c.
    assert running_ids(engine) >= {"a-long", "a2", "a3", "base"}
    assert {"c1", "b2", "d1"}.isdisjoint(running_ids(engine))
    assert engine.scheduler.room.draining == "b"
    assert "d" not in engine.residency

    while "c1" not in firsts:
        assert "b2" not in running_ids(engine) and "d" not in engine.residency
        assert "d1" not in firsts
        engine.step()
    # b drained and went; c took its pages; c1 started before any request of another new adapter.
    assert "b-short" in firsts and "b" not in engine.residency and "d1" not in firsts
    while engine.has_work():
        engine.step()
    assert set(firsts) == {"a-long", "b-short", "c1", "a2", "b2", "base", "d1", "a3"}
    assert engine.scheduler.room.draining is None
    engine.stop()


def test_a_pinned_adapter_is_never_the_one_drained(tiny_llama, adapters):
    """b's running request ends soonest, but b is pinned: draining it would free nothing (it is
    never evicted), so a drains and b's queued request still starts."""
    engine = two_slot_engine(tiny_llama, adapters)
    engine.residency.set_pinned(["b"])
    engine.submit(request("a-long", "a", max_tokens=40), lambda event: None)
    engine.submit(request("b-short", "b", max_tokens=6), lambda event: None)
    while running_ids(engine) != {"a-long", "b-short"}:
        engine.step()
    engine.submit(request("c1", "c", max_tokens=4), lambda event: None)
    engine.submit(request("b2", "b", max_tokens=4), lambda event: None)
    engine.step()
    assert engine.scheduler.room.draining == "a"
    assert "b2" in running_ids(engine) and "c1" not in running_ids(engine)
    engine.stop()


def test_a_request_still_without_room_once_the_drain_is_over_stops_admission(tiny_llama, adapters):
    """In the split region "wide" (rank 12) fits alone but not beside a held rank-8 adapter: once
    b drained, its pages are not enough, and the waiting request stops admission (no request
    behind it starts, a base-model one included) until a's requests end too; it starts before
    the ones behind it."""
    engine = two_slot_engine(tiny_llama, adapters)
    residency = engine.residency
    firsts: list[str] = []

    def sink(event) -> None:
        if event.token_id is not None and event.request_id not in firsts:
            firsts.append(event.request_id)

    engine.submit(request("a-long", "a", max_tokens=30), sink)
    engine.submit(request("b-short", "b", max_tokens=4), sink)
    while not {"a-long", "b-short"} <= set(firsts):
        engine.step()
    engine.submit(request("w1", "wide", max_tokens=4), sink)
    engine.submit(request("a2", "a", max_tokens=4), sink)
    engine.step()
    assert "a2" in running_ids(engine) and engine.scheduler.room.draining == "b"
    while "b-short" in running_ids(engine):
        engine.step()
    engine.submit(request("a3", "a", max_tokens=4), sink)
    engine.submit(request("base", None, max_tokens=4), sink)
    engine.step()  # b drained and went, but "wide" still does not fit beside a
    assert "b" not in residency or residency.get("b").refcount == 0
    assert "wide" not in residency and {"w1", "a3", "base"}.isdisjoint(running_ids(engine))
    while "w1" not in firsts:
        assert {"a3", "base"}.isdisjoint(firsts)
        engine.step()
    while engine.has_work():
        engine.step()
    assert firsts.index("w1") < min(firsts.index("a3"), firsts.index("base"))
    engine.stop()


def test_kv_room_still_stops_admission(tiny_llama, adapters):
    """No room for a request's KV still stops admission at it (a later one never overtakes)."""
    engine = two_slot_engine(tiny_llama, adapters)
    engine.submit(request("run", "a", max_tokens=4), lambda event: None)
    engine.step()
    kv = engine.scheduler.kv
    reserve = kv.reserve
    blocked = {"big"}

    def reserve_or_exhaust(r, tokens):
        if r.request_id in blocked:
            raise PoolExhausted(1, 0)
        return reserve(r, tokens)

    kv.reserve = reserve_or_exhaust
    engine.submit(request("big", "a", max_tokens=4), lambda event: None)
    engine.submit(request("small", "a", max_tokens=4), lambda event: None)
    engine.step()
    assert {"big", "small"}.isdisjoint(running_ids(engine))
    blocked.clear()
    engine.step()
    assert {"big", "small"} <= running_ids(engine)
    while engine.has_work():
        engine.step()
    engine.stop()
