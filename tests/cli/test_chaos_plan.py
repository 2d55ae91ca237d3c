"""The chaos command's pure parts: the kill plan (injected clock, seeded RNG), the request tally
and the report. The run against a real mesh is tests/e2e/test_chaos.py."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from loramesh_cli.chaos_commands import (
    KillPlan,
    RequestTally,
    chaos_report,
    live_processes,
    process_kind,
    restarts_per_process,
)
from loramesh_cli.main import main
from loramesh_cli.mesh_file import MeshFile, ServiceEntry


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


PROCESSES = ["etcd", "gateway", "gateway-1", "gpu_worker-0", "kv_manager", "scheduler-1"]


def plan(seed: int = 7, **overrides) -> tuple[KillPlan, FakeClock]:
    clock = FakeClock()
    settings = {"min_interval_s": 5.0, "max_interval_s": 10.0, "duration_s": 60.0} | overrides
    return KillPlan(seed, clock=clock, **settings), clock


def run_plan(kill_plan: KillPlan, clock: FakeClock) -> list[tuple[str, float]]:
    """Drive the plan as the command does, jumping the clock to each due kill."""
    kill_plan.start()
    kills = []
    while not kill_plan.finished():
        clock.now += kill_plan.seconds_until_next_kill()
        if kill_plan.kill_due():
            kill = kill_plan.choose_victim(PROCESSES)
            kills.append((kill.name, kill.at_s))
    return kills


def test_process_kind_drops_the_replica_index():
    assert [process_kind(n) for n in PROCESSES] == [
        "etcd", "gateway", "gateway", "gpu_worker", "kv_manager", "scheduler"
    ]  # fmt: skip


def test_kills_are_spaced_by_the_interval_and_stop_at_the_duration():
    kills = run_plan(*plan())
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(kills)]
    assert 5.0 <= kills[0][1] <= 10.0
    assert all(5.0 <= gap <= 10.0 for gap in gaps)
    assert kills[-1][1] < 60.0
    assert 6 <= len(kills) <= 12


def test_same_seed_same_sequence_other_seed_other_sequence():
    assert run_plan(*plan(seed=3)) == run_plan(*plan(seed=3))
    assert run_plan(*plan(seed=3)) != run_plan(*plan(seed=4))


def test_victims_do_not_depend_on_the_order_processes_are_listed():
    first, _ = plan(seed=11)
    second, _ = plan(seed=11)
    first.start()
    second.start()
    assert first.choose_victim(PROCESSES) == second.choose_victim(list(reversed(PROCESSES)))


def test_kills_per_kind_counts_replicas_together():
    kill_plan, clock = plan(seed=1, duration_s=1000.0)
    run_plan(kill_plan, clock)
    per_kind = kill_plan.kills_per_kind()
    assert sum(per_kind.values()) == len(kill_plan.kills)
    assert set(per_kind) == {"etcd", "gateway", "gpu_worker", "kv_manager", "scheduler"}
    assert per_kind["gateway"] == sum(1 for k in kill_plan.kills if k.name in ("gateway", "gateway-1"))


def test_nothing_alive_is_no_kill_and_the_next_try_one_interval_on():
    kill_plan, clock = plan()
    kill_plan.start()
    clock.now += kill_plan.seconds_until_next_kill()
    assert kill_plan.choose_victim([]) is None
    assert not kill_plan.kill_due() and kill_plan.kills == []
    assert 5.0 <= kill_plan.seconds_until_next_kill() <= 10.0


def test_the_wait_never_goes_past_the_end():
    kill_plan, clock = plan(min_interval_s=50.0, max_interval_s=50.0, duration_s=30.0)
    kill_plan.start()
    assert kill_plan.seconds_until_next_kill() == 30.0
    clock.now += 30.0
    assert kill_plan.finished() and not kill_plan.kill_due()


@pytest.mark.parametrize("settings", [{"min_interval_s": 0.0}, {"min_interval_s": 11.0}, {"duration_s": 0.0}])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        plan(**settings)


def test_tally_sorts_outcomes():
    tally = RequestTally()
    tally.sent = 4
    tally.completed("p", ((1, 2), "ab"), ((1, 2), "ab"))
    tally.completed("p", ((1, 2), "ab"), ((1, 3), "ac"))
    tally.failed(RuntimeError("gone"))
    assert (tally.identical, tally.different, tally.lost, tally.finished) == (1, 1, 1, 3)
    assert tally.first_differences == [{"prompt": "p", "expected": "ab", "got": "ac"}]
    assert tally.first_errors == ["gone"]


def mesh_with(pids: dict[str, int], up_pid: int = 1) -> MeshFile:
    services = {
        name: ServiceEntry(address="", http_address="", pid=pid, log="", restarts=i)
        for i, (name, pid) in enumerate(pids.items())
    }
    etcd = ServiceEntry(address="", http_address="", pid=os.getpid(), log="", restarts=5)
    return MeshFile(
        up_pid=up_pid, etcd_endpoint="", etcd_pid=0, admin_api_key="", services=services, etcd=etcd
    )


def test_live_processes_skip_the_down_the_dead_and_the_supervisor():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sibling = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )  # alive until killed
    try:
        mesh = mesh_with({"gateway": sibling.pid, "scheduler": 0, "kv_manager": dead.pid}, up_pid=os.getpid())
        # etcd runs as this test's own pid, which is also up_pid: never a victim.
        assert live_processes(mesh) == {"gateway": sibling.pid}
        assert restarts_per_process(mesh) == {"etcd": 5, "gateway": 0, "kv_manager": 2, "scheduler": 1}
    finally:
        sibling.kill()
        sibling.wait()


def test_report_counts_restarts_made_during_the_run():
    kill_plan, clock = plan(seed=2)
    kills = run_plan(kill_plan, clock)
    tally = RequestTally(sent=10, identical=10)
    report = chaos_report(kill_plan, tally, 3, {"gateway": 1, "etcd": 0}, {"gateway": 2, "etcd": 0}, {})
    assert report["requests_sent"] == 10 and report["completed_identical"] == 10
    assert report["completed_different"] == 0 and report["lost"] == 0 and report["sdk_failovers"] == 3
    assert report["kills"] == len(kills)
    assert report["restarts_during_run"] == {"gateway": 1}


def test_chaos_without_a_mesh_is_refused(tmp_path, capsys):
    assert main(["--state-dir", str(tmp_path), "chaos", "--duration", "1"]) == 1
    err = capsys.readouterr().err
    assert "no mesh is up" in err and str(tmp_path / "mesh.json") in err


def test_chaos_refuses_a_bad_interval(tmp_path, capsys):
    assert main(["--state-dir", str(tmp_path), "chaos", "--min-interval", "9", "--max-interval", "2"]) == 1
    assert "kill interval" in capsys.readouterr().err
