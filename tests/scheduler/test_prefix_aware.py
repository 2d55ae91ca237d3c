"""Prefix-aware placement alone, no gRPC: the scheduler's prefix index (longest cached run, LRU
bound, TTL, membership), the cost formula, and the keys' isolation — an adapter's prefix never
counts for another adapter of the same name with other weights, nor for another tenant; base
and activated-LoRA pre-invocation blocks count across adapters."""

from __future__ import annotations

import pytest

from services.runtime.config import parse_config
from services.runtime.errors import InvalidArgument
from services.runtime.prefix_keys import adapter_key_space, prompt_block_keys
from services.scheduler.cluster_view import ClusterSnapshot, ClusterView, WorkerState
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import PlacementRequest, WaitModel
from services.scheduler.policies import make_placement, uses_prefix_index
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.policies.prefix_aware import PrefixAware, PrefixAwareConfig
from services.scheduler.prefix_index import PrefixIndex, PrefixIndexConfig
from services.scheduler.service import SchedulerService

MODEL = WaitModel(adapter_load_ms=50, mean_output_tokens=128, max_running_hint=4, per_request_step_ms=10)
WEIGHTS = PrefixAwareConfig(prefill_ms_per_token=1.0, imbalance_ms_per_request=50.0)
SYSTEM = list(range(1000, 1320))  # a 320-token system prompt: 20 blocks of 16
INVOCATION = [7, 8, 9]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(worker_id: str, queue=0, running=0, resident=()) -> WorkerState:
    return WorkerState(worker_id, f"h:{worker_id}", queue=queue, running=running,
                       resident_adapters=frozenset(resident), tokens_per_s=128.0, report_ts=1.0)  # fmt: skip


def view(*workers: str, clock: Clock | None = None, **index) -> ClusterView:
    clock = clock or Clock()
    cluster = ClusterView(clock=clock, prefix_index=PrefixIndex(PrefixIndexConfig(**index), clock=clock))
    cluster.update_members({w: f"h:{w}" for w in workers})
    cluster.update_loads({w: {"tokens_per_s": 128.0, "ts": 1.0} for w in workers})
    return cluster


def blocks(prompt: list[int], namespace="tenant:acme", adapter: tuple[str, str] | None = None,
           invocation: list[int] | None = None) -> tuple[bytes, ...]:  # fmt: skip
    space = None if adapter is None else adapter_key_space(*adapter)
    return tuple(prompt_block_keys(namespace, prompt, 16, space, invocation))


def request(prompt: list[int], keys: tuple[bytes, ...], adapter_id="") -> PlacementRequest:
    return PlacementRequest(adapter_id=adapter_id, prompt_tokens=len(prompt), prefix_blocks=keys,
                            prefix_block_tokens=16)  # fmt: skip


def hits(cluster: ClusterView, wanted: PlacementRequest) -> dict[str, int]:
    snap = cluster.snapshot_for(wanted.prefix_blocks, wanted.prefix_block_tokens, wanted.prompt_tokens)
    return dict(snap.prefix_hit_tokens)


# -- the index ------------------------------------------------------------------------------------


def test_a_hit_is_the_longest_run_of_blocks_from_the_first():
    index = PrefixIndex(clock=Clock())
    keys = blocks(SYSTEM)
    index.record("w1", keys[:12])
    assert index.hit_blocks("w1", keys) == 12
    # A prompt that differs from token 50 on shares only the 3 blocks before it.
    assert index.hit_blocks("w1", blocks(SYSTEM[:50] + [1] + SYSTEM[51:])) == 3
    assert index.hit_blocks("w2", keys) == 0
    assert index.hits(["w1", "w2"], keys) == {"w1": 12}


def test_the_bound_evicts_the_least_recently_placed_tails_first_and_the_ttl_ages_blocks_out():
    clock = Clock()
    index = PrefixIndex(PrefixIndexConfig(max_blocks_per_worker=25, ttl_s=60), clock=clock)
    first, second = blocks(SYSTEM), blocks(list(range(5000, 5160)))  # 20 and 10 blocks
    index.record("w1", first)
    clock.now += 1
    index.record("w1", second)
    assert index.size("w1") == 25
    assert index.hit_blocks("w1", second) == 10
    assert index.hit_blocks("w1", first) == 15  # its 5 last blocks went, its head stayed
    clock.now += 59.5  # the first prompt's blocks are past their TTL, the second's not yet
    assert index.hit_blocks("w1", first) == 0 and index.hit_blocks("w1", second) == 10
    assert index.expire() == 15 and index.size() == 10
    index.forget("w1")
    assert index.size() == 0


def test_a_worker_that_leaves_takes_its_blocks_and_one_that_returns_starts_empty():
    cluster = view("w1", "w2")
    keys = blocks(SYSTEM)
    cluster.record_placement("w1", "", keys)
    assert hits(cluster, request(SYSTEM + [1, 2], keys)) == {"w1": 320}
    cluster.update_members({"w2": "h:w2"})
    assert cluster.prefix_index.size() == 0
    cluster.update_members({"w1": "h:w1", "w2": "h:w2"})
    assert hits(cluster, request(SYSTEM + [1, 2], keys)) == {}


def test_hits_leave_the_prompts_last_token_to_compute_and_are_counted_when_placed():
    cluster = view("w1")
    keys = blocks(SYSTEM)
    cluster.record_placement("w1", "", keys)
    assert hits(cluster, request(SYSTEM, keys)) == {"w1": 319}
    cluster.record_placement("w1", "", keys, cached_prefix_tokens=319)
    assert (cluster.placements_total, cluster.prefix_hit_placements, cluster.prefix_hit_tokens) == (2, 1, 319)


# -- isolation --------------------------------------------------------------------------------


def test_same_name_different_weights_never_hit_each_others_prefix():
    """vLLM #44250 / LMCache #2961: one prompt under two adapters with identical names (and ids)
    and different weights. Their key spaces differ by the weights' digest: 0 hits."""
    cluster = view("w1", "w2")
    prompt = SYSTEM + [11, 12]
    mine = blocks(prompt, adapter=("acme/checker", "a" * 64))
    theirs = blocks(prompt, adapter=("acme/checker", "b" * 64))
    cluster.record_placement("w1", "acme/checker", mine)
    assert hits(cluster, request(prompt, mine, "acme/checker")) == {"w1": 320}
    wanted = request(prompt, theirs, "acme/checker")
    assert hits(cluster, wanted) == {}
    assert not set(mine) & set(theirs)
    # Nor does the base model's prompt: a standard LoRA's blocks are its own.
    assert hits(cluster, request(prompt, blocks(prompt))) == {}


def test_a_tenants_prefix_reaches_only_its_namespace_and_a_shared_salt_reaches_both():
    cluster = view("w1", "w2")
    prompt = SYSTEM + [11]
    cluster.record_placement("w1", "", blocks(prompt, "tenant:acme"))
    assert hits(cluster, request(prompt, blocks(prompt, "tenant:other"))) == {}
    cluster.record_placement("w2", "", blocks(prompt, "salt:s3cret"))  # sent by tenant acme
    assert hits(cluster, request(prompt, blocks(prompt, "salt:s3cret"))) == {"w2": 320}  # by any tenant
    assert hits(cluster, request(prompt, blocks(prompt, "salt:other"))) == {}


def test_base_and_activated_lora_prefixes_count_across_adapters():
    cluster = view("w1", "w2", "w3")
    base_prompt = SYSTEM + [11, 12]
    cluster.record_placement("w2", "", blocks(base_prompt))  # a base-model turn
    checked = SYSTEM + INVOCATION + [21, 22]  # then two aLoRA checkers read the same prompt
    for adapter in (("acme/grader", "c" * 64), ("acme/safety", "d" * 64)):
        keys = blocks(checked, adapter=adapter, invocation=INVOCATION)
        assert hits(cluster, request(checked, keys, adapter[0])) == {"w2": 320}


# -- the cost ----------------------------------------------------------------------------------


def test_with_zero_weights_it_places_as_least_estimated_wait():
    cluster = view("w1", "w2", "w3")
    keys = blocks(SYSTEM)
    cluster.record_placement("w3", "a", keys)
    snaps = [
        cluster.snapshot_for(keys, 16, 330),
        ClusterSnapshot.of([worker("w1", queue=1), worker("w2", resident={"a"}), worker("w3", running=3)]),
    ]
    plain = PrefixAware(MODEL, PrefixAwareConfig(prefill_ms_per_token=0, imbalance_ms_per_request=0))
    for snap in snaps:
        wanted = request(SYSTEM + list(range(10)), keys, "a")
        assert plain.place(snap, wanted) == LeastEstimatedWait(MODEL).place(snap, wanted)


def test_a_cached_prefix_draws_the_request_until_its_holder_is_loaded_enough():
    snap = ClusterSnapshot.of([worker("w1", resident={"a"}), worker("w2", resident={"a"})])
    wanted = request(SYSTEM + [1, 2], blocks(SYSTEM + [1, 2]), "a")
    policy = PrefixAware(MODEL, WEIGHTS)
    assert policy.place(snap, wanted).worker_id == "w1"  # a tie: the smaller id
    # w2 holds 320 of its tokens: 320 ms of prefill saved beats 2 requests there (2 x 50 ms
    # imbalance + the wait model's batch and queue cost), not 3 queued ahead of it.
    cached = snap.with_prefix_hits({"w2": 320})
    for running, where in ((1, "w2"), (2, "w2")):
        loaded = ClusterSnapshot.of(
            [worker("w1", resident={"a"}), worker("w2", running=running, resident={"a"})]
        )
        chosen = policy.place(loaded.with_prefix_hits({"w2": 320}), wanted)
        assert (chosen.worker_id, chosen.cached_prefix_tokens) == (where, 320)
    assert policy.place(cached, wanted).worker_id == "w2"
    busy = ClusterSnapshot.of([worker("w1", resident={"a"}), worker("w2", queue=3, resident={"a"})])
    assert policy.place(busy.with_prefix_hits({"w2": 320}), wanted).worker_id == "w1"


def test_residency_still_counts_beside_the_prefix():
    wanted = request(SYSTEM[:32] + [1], blocks(SYSTEM[:32] + [1]), "a")  # 32 cached tokens: 32 ms
    snap = ClusterSnapshot.of([worker("w1", resident={"a"}), worker("w2")]).with_prefix_hits({"w2": 32})
    assert PrefixAware(MODEL, WEIGHTS).place(snap, wanted).worker_id == "w1"  # 50 ms adapter load


# -- configuration and input -------------------------------------------------------------------


def test_config_selects_it_and_rejects_bad_weights_and_requests():
    config = parse_config(
        SchedulerConfig, ["--placement", "prefix-aware", "--prefix-prefill-ms-per-token", "0.5"]
    )
    service = SchedulerService(config)
    assert service.policy.name == "prefix-aware" and uses_prefix_index(service.policy)
    assert service.policy.config.prefill_ms_per_token == 0.5
    assert service.view.prefix_index is not None
    plain = parse_config(SchedulerConfig, ["--placement", "least-estimated-wait"])
    assert SchedulerService(plain).view.prefix_index is None
    assert make_placement("prefix-aware").config == PrefixAwareConfig()
    with pytest.raises(ValueError, match="--prefix-imbalance-ms-per-request"):
        SchedulerConfig(prefix_imbalance_ms_per_request=-1)
    with pytest.raises(ValueError, match="prefill_ms_per_token"):
        PrefixAwareConfig(prefill_ms_per_token=float("nan"))
    with pytest.raises(InvalidArgument, match="prefix_block_tokens must be >= 1"):
        PlacementRequest(prefix_blocks=(b"x" * 32,))
    with pytest.raises(InvalidArgument, match="over 64 bytes"):
        PlacementRequest(prefix_blocks=(b"x" * 65,), prefix_block_tokens=16)


def test_with_no_hit_anywhere_it_places_as_least_estimated_wait_whatever_the_weights():
    snap = ClusterSnapshot.of([worker("w1", queue=1, resident={"a"}), worker("w2", running=3), worker("w3")])
    wanted = request(SYSTEM, blocks(SYSTEM), "a")
    assert PrefixAware(MODEL, WEIGHTS).place(snap, wanted) == LeastEstimatedWait(MODEL).place(snap, wanted)
