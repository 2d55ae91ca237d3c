"""The nemesis round's report: per fault the operations during and after it, the time to serving
and the stalls of the streams in flight; a failover line per kill kind; the verdict last."""

from __future__ import annotations

import pytest

from bench.cluster.checker import check
from bench.cluster.faults import Applied
from bench.cluster.history import Op, OpKind, Outcome, Sampling
from bench.cluster.nemesis import NemesisConfig, RoundResult, round_report, run_round
from bench.cluster.observations import Heal
from bench.cluster.schedule import Fault, NemesisKind


def stream(op_id: int, invoked: float, arrivals: list[float], completed: float) -> Op:
    return Op(op_id, "s", OpKind.GENERATE_STREAM, "p", invoked, completed, Outcome.OK, finish_reason="length", sampling=Sampling.SAMPLED,
              tokens=tuple((i, 7) for i in range(len(arrivals))), arrived_at=tuple(arrivals))  # fmt: skip


def test_the_report_names_each_fault_and_the_failover_stall_of_each_kill_kind():
    kill = Fault("f0", NemesisKind.KILL_NODE, "kill-node", nodes=("node1",), pods=("gpu-worker-0",))
    loss = Fault("f1", NemesisKind.LOSS, "loss", nodes=("node0", "node1"), loss_percent=5.0)
    ops = (
        stream(0, 9.0, [9.5, 16.0, 16.5], 17.0),  # in flight at the kill: 6.5 s without a token
        stream(1, 9.8, [10.5, 11.0], 11.5),  # 0.7 s across it
        stream(2, 12.0, [13.0], 14.0),  # invoked during the kill
        stream(3, 30.0, [30.5, 31.0], 31.5),  # during the loss
    )
    applied = [(10.0, 20.0, Applied(kill)), (29.0, 35.0, Applied(loss))]
    heals = [Heal(kill.label, 20.0, {"gpu-worker-0": 24.0}), Heal(loss.label, 35.0, {"mesh": 35.5})]
    result = RoundResult(check(ops, heals=heals), ops, applied, heals, [])
    lines = round_report(result, started=0.0).splitlines()
    assert lines[0] == (
        "f0 kill-node/kill-node at 10.0 s for 10.0 s: during 1/1 ops ok (100%), after no ops; serving again "
        "4.0 s after the heal; 2 streams in flight, 2 finished: stall p50 0.7 s, p99 6.5 s "
        "(across it p50 0.7 s, p99 6.5 s)"
    )
    assert lines[1].startswith("f1 loss/loss at 29.0 s for 6.0 s: during 1/1 ops ok (100%)")
    assert lines[1].endswith("no stream in flight")
    assert lines[2] == (
        "failover after kill-node (1): 2 streams in flight, 2 finished: stall p50 0.7 s, p99 6.5 s "
        "(across it p50 0.7 s, p99 6.5 s)"
    )
    assert lines[-1] == result.verdict.summary


def test_a_directory_holding_an_earlier_round_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "load").mkdir()
    (tmp_path / "load" / "stop").touch()  # what an earlier round leaves: it would end the load at once
    config = NemesisConfig((NemesisKind.KILL_POD,), 60.0, 1, "client", tmp_path)
    with pytest.raises(ValueError, match="holds an earlier round's results"):
        run_round(None, config)  # type: ignore[arg-type] - refused before the overlay is read
