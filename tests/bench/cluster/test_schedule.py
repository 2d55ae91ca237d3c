"""The nemesis's fault schedule: seeded, deterministic, one fault at a time, every scenario the
cluster's shape allows, symbolic targets where only the run can tell."""

from __future__ import annotations

import pytest

from bench.cluster.schedule import (
    ETCD_LEADER,
    LENDING_CREDITOR,
    ClusterShape,
    NemesisKind,
    Role,
    ScheduleConfig,
    fault_schedule,
    parse_kinds,
)

ALL = parse_kinds("partition,latency,loss,kill-pod,kill-node")


def three_nodes() -> ClusterShape:
    return ClusterShape.of(
        {
            f"node{n}": [
                (f"etcd-{n}", Role.ETCD),
                (f"gpu-worker-{n}", Role.WORKER),
                (f"gateway-{n}", Role.GATEWAY),
                (f"scheduler-{n}", Role.SCHEDULER),
                (f"kv-manager-{n}", Role.KV_MANAGER),
                (f"adapter-store-{n}", Role.STORE),
            ]
            for n in range(3)
        }
    )


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    shape = three_nodes()
    first = fault_schedule(shape, ScheduleConfig(seed=7, duration_s=600, kinds=ALL))
    assert first == fault_schedule(shape, ScheduleConfig(seed=7, duration_s=600, kinds=ALL))
    assert [e.to_json() for e in first] != [
        e.to_json() for e in fault_schedule(shape, ScheduleConfig(seed=8, duration_s=600, kinds=ALL))
    ]


def test_one_fault_at_a_time_healed_before_the_tail():
    config = ScheduleConfig(seed=3, duration_s=600, kinds=ALL)
    events = fault_schedule(three_nodes(), config)
    assert [e.action for e in events] == ["start", "heal"] * (len(events) // 2)
    for start, heal in zip(events[::2], events[1::2], strict=True):
        assert start.fault == heal.fault and start.at_s < heal.at_s
    times = [e.at_s for e in events]
    assert times == sorted(times) and times[0] >= config.warmup_s
    assert times[-1] <= config.duration_s - config.tail_s
    assert [e.fault.id for e in events[::2]] == [f"f{i}" for i in range(len(events) // 2)]


def test_a_round_covers_every_scenario_and_cuts_the_etcd_leader_after_a_minority():
    events = fault_schedule(three_nodes(), ScheduleConfig(seed=1, duration_s=3600, kinds=ALL))
    faults = [e.fault for e in events[::2]]
    first_round = [f.scenario for f in faults[:9]]
    assert sorted(first_round) == sorted(
        ["etcd-minority", "etcd-leader", "worker-from-etcd", "gateway-from-schedulers",
         "creditor-mid-borrow", "latency", "loss", "kill-pod", "kill-node"]
    )  # fmt: skip
    assert first_round.index("etcd-leader") == first_round.index("etcd-minority") + 1
    by_scenario = {f.scenario: f for f in faults}
    assert len(by_scenario["etcd-minority"].isolate) == 1
    assert by_scenario["etcd-minority"].isolate[0].startswith("etcd-")
    assert by_scenario["etcd-leader"].isolate == (ETCD_LEADER,)
    worker = by_scenario["worker-from-etcd"]
    assert worker.isolate[0].startswith("gpu-worker-") and worker.from_pods == ("etcd-0", "etcd-1", "etcd-2")
    gateway = by_scenario["gateway-from-schedulers"]
    assert gateway.isolate[0].startswith("gateway-") and all(
        p.startswith("scheduler-") for p in gateway.from_pods
    )
    creditor = by_scenario["creditor-mid-borrow"]
    assert (creditor.isolate, creditor.during) == ((LENDING_CREDITOR,), "borrowed-request")
    node = by_scenario["kill-node"]
    assert len(node.pods) == 6 and all(p.endswith(node.nodes[0][-1]) for p in node.pods)
    for fault in faults:
        if fault.kind == NemesisKind.LATENCY:
            assert 2.0 <= fault.delay_ms <= 50.0 and len(set(fault.nodes)) == 2
        if fault.kind == NemesisKind.LOSS:
            assert fault.loss_percent == 5.0 and len(set(fault.nodes)) == 2


def test_only_the_kinds_asked_for():
    events = fault_schedule(
        three_nodes(), ScheduleConfig(seed=2, duration_s=300, kinds=parse_kinds("kill-pod"))
    )
    assert events and {e.fault.kind for e in events} == {NemesisKind.KILL_POD}


def test_what_cannot_be_scheduled_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown nemesis 'flood'"):
        parse_kinds("partition,flood")
    one_node = ClusterShape.of({"node0": [("etcd-0", Role.ETCD)]})
    with pytest.raises(ValueError, match="nemesis latency has nothing to act on in a cluster of 1 node"):
        fault_schedule(one_node, ScheduleConfig(seed=0, duration_s=600, kinds=(NemesisKind.LATENCY,)))
    with pytest.raises(ValueError, match="a run of 20 s leaves no room for a fault"):
        fault_schedule(three_nodes(), ScheduleConfig(seed=0, duration_s=20, kinds=ALL))
    with pytest.raises(ValueError, match="pod names repeat"):
        ClusterShape.of({"a": [("p", Role.ETCD)], "b": [("p", Role.WORKER)]})
