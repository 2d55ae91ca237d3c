"""The placement policies behind one interface: round-robin, least-loaded, the registry, the flag."""

from __future__ import annotations

import pytest

from services.runtime.config import parse_config
from services.runtime.errors import Unavailable
from services.scheduler.cluster_view import ClusterSnapshot, WorkerState
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import PlacementRequest, WaitModel
from services.scheduler.policies import PLACEMENT_POLICIES, make_placement
from services.scheduler.policies.least_loaded import LeastLoaded
from services.scheduler.policies.prefix_aware import PrefixAware
from services.scheduler.policies.round_robin import RoundRobin
from services.scheduler.service import SchedulerService

MODEL = WaitModel(adapter_load_ms=50, mean_output_tokens=128, max_running_hint=4, per_request_step_ms=0)


def worker(worker_id: str, queue=0, running=0, resident=()) -> WorkerState:
    return WorkerState(worker_id, f"h:{worker_id}", queue=queue, running=running,
                       resident_adapters=frozenset(resident), tokens_per_s=128.0, report_ts=1.0)  # fmt: skip


def test_round_robin_cycles_in_id_order_whatever_the_load():
    snap = ClusterSnapshot.of([worker("w2", queue=9), worker("w1"), worker("w3", resident={"a"})])
    policy = RoundRobin(MODEL)
    picks = [policy.place(snap, PlacementRequest(adapter_id="a")).worker_id for _ in range(4)]
    assert picks == ["w1", "w2", "w3", "w1"]


def test_round_robin_cursor_survives_a_worker_leaving_and_skips_excluded_ones():
    policy = RoundRobin(MODEL)
    full = ClusterSnapshot.of([worker("w1"), worker("w2"), worker("w3")])
    assert policy.place(full, PlacementRequest()).worker_id == "w1"
    assert policy.place(full.without({"w2"}), PlacementRequest()).worker_id == "w3"
    request = PlacementRequest(exclude_workers=frozenset({"w1"}))
    assert policy.place(full, request).worker_id == "w2"


def test_round_robin_reports_the_wait_model_estimate_of_its_pick():
    snap = ClusterSnapshot.of([worker("w1", queue=2)])
    chosen = RoundRobin(MODEL).place(snap, PlacementRequest(adapter_id="a"))
    assert chosen.estimated_wait_ms == pytest.approx(2050) and not chosen.adapter_resident


def test_least_loaded_counts_queue_running_and_unreported_placements_and_ignores_adapters():
    snap = ClusterSnapshot.of(
        [worker("w1", queue=1, running=1, resident={"a"}), worker("w2", running=1), worker("w3")],
        {"w3": 2},
    )
    chosen = LeastLoaded(MODEL).place(snap, PlacementRequest(adapter_id="a"))
    assert chosen.worker_id == "w2"  # loads 2, 1, 2; the adapter's home w1 does not matter
    assert chosen.adapter_load_ms == 50


def test_least_loaded_ties_go_to_the_smallest_id():
    snap = ClusterSnapshot.of([worker("w2"), worker("w1")])
    assert LeastLoaded(MODEL).place(snap, PlacementRequest()).worker_id == "w1"


@pytest.mark.parametrize("name", sorted(PLACEMENT_POLICIES))
def test_every_policy_is_unavailable_without_workers_and_named_as_registered(name):
    policy = make_placement(name, MODEL)
    assert policy.name == name
    with pytest.raises(Unavailable):
        policy.place(ClusterSnapshot.of([]), PlacementRequest())


def test_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="least-estimated-wait, least-loaded, prefix-aware, round-robin"):
        make_placement("random", MODEL)


def test_placement_flag_selects_the_policy_and_defaults_to_prefix_aware():
    default = SchedulerService(parse_config(SchedulerConfig, [], environ={}))
    assert isinstance(default.policy, PrefixAware)
    chosen = SchedulerService(parse_config(SchedulerConfig, ["--placement", "round-robin"], environ={}))
    assert isinstance(chosen.policy, RoundRobin)
    assert chosen.admission.model == chosen.policy.model
