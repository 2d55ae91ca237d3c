"""The placement policy, admission and cluster view as pure objects: no processes, no etcd."""

from __future__ import annotations

import pytest

from services.runtime.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.scheduler.admission import AdmissionConfig, AdmissionControl
from services.scheduler.cluster_view import ClusterSnapshot, ClusterView, WorkerState, worker_state
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait

# 128 tokens per request at 128 tokens/s: one completion per second on a busy worker.
# The batch term is tested on its own below; without it the queue arithmetic reads plainly.
MODEL = WaitModel(
    adapter_load_ms=50,
    mean_output_tokens=128,
    default_service_ms=1000,
    max_running_hint=4,
    per_request_step_ms=0,
)


def worker(worker_id: str, queue=0, running=0, resident=(), tokens_per_s=128.0, ts=1.0) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        address=f"10.0.0.{worker_id[-1]}:50051",
        queue=queue,
        running=running,
        free_pages=100,
        total_pages=200,
        resident_adapters=frozenset(resident),
        tokens_per_s=tokens_per_s,
        report_ts=ts,
    )


def place(
    snapshot: ClusterSnapshot, admission: AdmissionControl | None = None, **request
) -> PlacementDecision:
    admission = admission or AdmissionControl(AdmissionConfig(max_queue_per_worker=8), MODEL)
    return admission.place(LeastEstimatedWait(MODEL), snapshot, PlacementRequest(**request))


# -- the wait model ----------------------------------------------------------------------------


def test_wait_is_queue_ahead_times_service_interval_plus_adapter_load():
    snap = ClusterSnapshot.of([worker("w1", queue=3, running=4, tokens_per_s=64.0)], {"w1": 2})
    estimate = MODEL.estimate(snap, snap.workers[0], PlacementRequest(adapter_id="sql"))
    # ahead = queue 3 + placed 2 + (running 4 + 1 - hint 4) = 6; interval = 128 / 64 s = 2000 ms
    assert estimate.ahead == 6
    assert estimate.queue_wait_ms == pytest.approx(12_000)
    assert estimate.adapter_load_ms == 50 and not estimate.adapter_resident
    assert estimate.estimated_wait_ms == pytest.approx(12_050)


def test_idle_worker_uses_the_default_interval_and_floors_slow_throughput():
    idle = worker("w1", queue=2, tokens_per_s=0.0)
    crawling = worker("w2", queue=1, tokens_per_s=0.001)
    snap = ClusterSnapshot.of([idle, crawling])
    assert MODEL.estimate(snap, idle, PlacementRequest()).queue_wait_ms == pytest.approx(2000)
    assert MODEL.service_interval_ms(crawling) == pytest.approx(128_000)  # floor of 1 token/s


def test_load_time_from_bytes_and_bandwidth_when_known():
    model = WaitModel(adapter_load_ms=50, load_bandwidth_bytes_per_s=1e9)
    assert model.load_ms(PlacementRequest(adapter_id="a", adapter_bytes=20_000_000)) == pytest.approx(20)
    assert model.load_ms(PlacementRequest(adapter_id="a")) == 50
    assert model.load_ms(PlacementRequest()) == 0  # base model: nothing to load


@pytest.mark.parametrize(
    "kwargs", [{"adapter_load_ms": -1}, {"mean_output_tokens": 0}, {"max_running_hint": 0}]
)
def test_wait_model_refuses_nonsense(kwargs):
    with pytest.raises(ValueError):
        WaitModel(**kwargs)


def test_negative_deadline_is_invalid():
    with pytest.raises(InvalidArgument, match="first_token_deadline_ms"):
        PlacementRequest(first_token_deadline_ms=-5)


# -- least estimated wait ----------------------------------------------------------------------


def test_resident_adapter_wins_over_an_equal_queue():
    snap = ClusterSnapshot.of([worker("w1"), worker("w2", resident={"sql"}), worker("w3")])
    chosen = place(snap, adapter_id="sql")
    assert (chosen.worker_id, chosen.adapter_resident, chosen.estimated_wait_ms) == ("w2", True, 0)
    assert chosen.address == "10.0.0.2:50051"


def test_shorter_queue_wins_when_it_outweighs_the_adapter_load():
    snap = ClusterSnapshot.of([worker("w1", queue=2, resident={"sql"}), worker("w2", queue=0)])
    chosen = place(snap, adapter_id="sql")  # 2000 ms queueing vs 50 ms load
    assert (chosen.worker_id, chosen.adapter_resident) == ("w2", False)
    assert chosen.estimated_wait_ms == pytest.approx(50)


def test_adapter_load_outweighs_a_short_queue_when_loading_is_slow():
    slow = WaitModel(adapter_load_ms=5000, mean_output_tokens=128, max_running_hint=4)
    snap = ClusterSnapshot.of([worker("w1", queue=2, resident={"sql"}), worker("w2")])
    chosen = LeastEstimatedWait(slow).place(snap, PlacementRequest(adapter_id="sql"))
    assert chosen.worker_id == "w1" and chosen.estimated_wait_ms == pytest.approx(2000)


def test_full_batch_makes_a_new_request_wait_for_one_completion():
    snap = ClusterSnapshot.of([worker("w1", running=4), worker("w2", running=3)])
    chosen = place(snap)
    assert chosen.worker_id == "w2" and chosen.estimated_wait_ms == 0
    full = MODEL.estimate(snap, snap.workers[0], PlacementRequest())
    assert full.ahead == 1 and full.queue_wait_ms == pytest.approx(1000)


def test_a_busier_batch_outweighs_adapter_affinity():
    model = WaitModel(adapter_load_ms=50, per_request_step_ms=10)
    snap = ClusterSnapshot.of([worker("w1", running=8, resident={"sql"}), worker("w2", running=0)])
    chosen = LeastEstimatedWait(model).place(snap, PlacementRequest(adapter_id="sql"))
    assert (chosen.worker_id, chosen.estimated_wait_ms) == ("w2", pytest.approx(50))  # 80 ms > 50 ms
    snap = ClusterSnapshot.of([worker("w1", running=3, resident={"sql"}), worker("w2", running=0)])
    chosen = LeastEstimatedWait(model).place(snap, PlacementRequest(adapter_id="sql"))
    assert (chosen.worker_id, chosen.estimated_wait_ms) == ("w1", pytest.approx(30))  # 30 ms < 50 ms


def test_ties_go_to_fewest_running_then_smallest_id():
    snap = ClusterSnapshot.of([worker("w3", running=1), worker("w2", running=2), worker("w1", running=1)])
    assert place(snap).worker_id == "w1"
    snap = ClusterSnapshot.of([worker("w2", running=0), worker("w1", running=2)])
    assert place(snap).worker_id == "w2"


def test_placements_since_the_report_count_as_queue_and_their_adapters_as_resident():
    snap = ClusterSnapshot.of([worker("w1"), worker("w2")], {"w1": 1}, {"w1": {"chat"}})
    # w1 already holds one unreported request: 1000 ms; w2 needs the adapter: 50 ms.
    assert place(snap, adapter_id="chat").worker_id == "w2"
    slow = WaitModel(adapter_load_ms=5000, mean_output_tokens=128, max_running_hint=4)
    chosen = LeastEstimatedWait(slow).place(snap, PlacementRequest(adapter_id="chat"))
    assert (chosen.worker_id, chosen.adapter_resident) == ("w1", True)


def test_excluded_workers_are_never_chosen():
    snap = ClusterSnapshot.of([worker("w1", resident={"sql"}), worker("w2", queue=3)])
    chosen = place(snap, adapter_id="sql", exclude_workers=frozenset({"w1"}))
    assert chosen.worker_id == "w2"
    with pytest.raises(Unavailable, match="excluded"):
        place(snap, exclude_workers=frozenset({"w1", "w2"}))


def test_no_live_worker_is_unavailable():
    with pytest.raises(Unavailable, match="no gpu_worker is live"):
        place(ClusterSnapshot.of([]))
    with pytest.raises(Unavailable):
        LeastEstimatedWait(MODEL).place(ClusterSnapshot.of([]), PlacementRequest())


# -- admission ---------------------------------------------------------------------------------


def test_full_queues_are_skipped_and_all_full_is_resource_exhausted_with_a_retry_hint():
    admission = AdmissionControl(AdmissionConfig(max_queue_per_worker=4), MODEL)
    # w1 has the adapter and the shortest reported queue, but 2 unreported placements fill it.
    snap = ClusterSnapshot.of([worker("w1", queue=2, resident={"sql"}), worker("w2", queue=3)], {"w1": 2})
    assert place(snap, admission, adapter_id="sql").worker_id == "w2"

    full = ClusterSnapshot.of([worker("w1", queue=4), worker("w2", queue=5, tokens_per_s=256.0)])
    with pytest.raises(ResourceExhausted) as err:
        place(full, admission)
    message = err.value.message
    assert "queue is full" in message and "bound of 4" in message and "w1 4+0" in message
    # w1 drains below the bound after 1 completion (1 s); w2 after 2 at 0.5 s each.
    assert err.value.retry_after_s == pytest.approx(1.0)


def test_deadline_that_no_worker_can_meet_is_refused_at_once():
    snap = ClusterSnapshot.of([worker("w1", queue=3), worker("w2", queue=2)])
    with pytest.raises(ResourceExhausted) as err:
        place(snap, first_token_deadline_ms=500)
    assert "deadline of 500 ms" in err.value.message and "2000 ms on w2" in err.value.message
    assert err.value.retry_after_s == pytest.approx(1.5)
    assert place(snap, first_token_deadline_ms=2500).worker_id == "w2"


def test_default_deadline_applies_to_requests_without_one():
    admission = AdmissionControl(AdmissionConfig(default_deadline_ms=100), MODEL)
    snap = ClusterSnapshot.of([worker("w1", queue=1)])
    with pytest.raises(ResourceExhausted, match="deadline of 100 ms"):
        place(snap, admission)
    assert place(snap, admission, first_token_deadline_ms=5000).worker_id == "w1"


def test_adapter_load_alone_can_miss_a_tight_deadline():
    snap = ClusterSnapshot.of([worker("w1"), worker("w2")])
    with pytest.raises(ResourceExhausted, match="50 ms adapter load"):
        place(snap, adapter_id="sql", first_token_deadline_ms=10)
    assert place(snap, first_token_deadline_ms=10).estimated_wait_ms == 0


# -- the cluster view --------------------------------------------------------------------------


def report(queue=0, running=0, resident=(), ts=1.0, **extra) -> dict:
    return {
        "queue": queue,
        "running": running,
        "free_pages": 10,
        "total_pages": 20,
        "kv_pages": 5,
        "adapter_pages": 5,
        "resident_adapters": list(resident),
        "tokens_per_s": 50.0,
        "preemptions": 0,
        "fragmentation": 0.1,
        "ts": ts,
        **extra,
    }


def test_view_tracks_members_reports_and_placements():
    view = ClusterView(clock=lambda: 10.0)
    view.update_members({"w1": "a:1", "w2": "a:2"})
    view.update_loads({"w1": report(queue=2, resident={"sql"}), "w9": report()})
    view.record_placement("w1", "chat")
    view.record_placement("w1")
    view.record_placement("gone", "x")  # not a member: ignored
    snap = view.snapshot()
    assert [w.worker_id for w in snap.workers] == ["w1", "w2"]
    w1, w2 = snap.workers
    assert (w1.queue, w1.resident_adapters, w1.tokens_per_s, w1.report_ts) == (2, {"sql"}, 50.0, 1.0)
    assert (w2.queue, w2.report_ts) == (0, 0.0)  # no report yet: an idle worker
    assert snap.placed("w1") == 2 and snap.will_have("w1", "chat") and snap.will_have("w1", "sql")
    assert snap.taken_at == 10.0 and view.placements_total == 2 and len(view) == 2
    # The snapshot is a copy: later changes do not reach it.
    view.record_placement("w2")
    assert snap.placed("w2") == 0 and view.snapshot().placed("w2") == 1


def test_a_newer_report_resets_that_workers_placements_only():
    view = ClusterView()
    view.update_members({"w1": "a:1", "w2": "a:2"})
    view.update_loads({"w1": report(ts=1.0), "w2": report(ts=1.0)})
    for wid in ("w1", "w1", "w2"):
        view.record_placement(wid, "sql")
    view.update_loads({"w1": report(ts=1.0), "w2": report(ts=1.0)})  # same reports again
    assert view.snapshot().placed("w1") == 2
    view.update_loads({"w1": report(queue=2, ts=2.0, resident={"sql"}), "w2": report(ts=1.0)})
    snap = view.snapshot()
    assert snap.placed("w1") == 0 and not snap.placed_adapters.get("w1")
    assert snap.placed("w2") == 1 and snap.will_have("w2", "sql")
    assert snap.worker("w1").queue == 2


def test_stale_placements_no_longer_steer_the_policy_after_a_newer_report():
    view = ClusterView()
    view.update_members({"w1": "a:1", "w2": "a:2"})
    view.update_loads({"w1": report(ts=1.0), "w2": report(ts=1.0)})
    policy = LeastEstimatedWait(MODEL)
    view.record_placement("w1")
    view.record_placement("w1")
    assert policy.place(view.snapshot(), PlacementRequest()).worker_id == "w2"
    view.update_loads({"w1": report(ts=2.0), "w2": report(queue=1, ts=1.0)})
    assert policy.place(view.snapshot(), PlacementRequest()).worker_id == "w1"


def test_a_worker_whose_member_key_disappears_is_gone_at_once():
    view = ClusterView()
    view.update_members({"w1": "a:1", "w2": "a:2"})
    view.update_loads({"w1": report(), "w2": report()})
    view.record_placement("w2", "sql")
    view.update_members({"w1": "a:1"})
    snap = view.snapshot()
    assert [w.worker_id for w in snap.workers] == ["w1"] and snap.placed("w2") == 0
    view.update_members({"w1": "a:1", "w2": "a:2"})  # back (its report is still there)
    assert view.snapshot().placed("w2") == 0 and view.snapshot().worker("w2").running == 0


def test_malformed_report_fields_read_as_zero():
    state = worker_state("w1", "a:1", {"queue": "lots", "running": -3, "tokens_per_s": float("nan"),
                                       "resident_adapters": "sql", "total_pages": 7.0})  # fmt: skip
    assert (state.queue, state.running, state.tokens_per_s, state.total_pages) == (0, 0, 0.0, 7)
    assert state.resident_adapters == frozenset()
