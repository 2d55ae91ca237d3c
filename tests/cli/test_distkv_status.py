"""``loramesh status``'s DistKV table, from heartbeats as etcd holds them (WorkerLoad JSON)."""

from __future__ import annotations

from loramesh_cli.distkv_status import DISTKV_KEYS, POLICY_KEYS, distkv_table
from mesh_api.v1.types_pb2 import WorkerLoad
from services.runtime.etcd.worker_load import worker_load_to_report


def row(service: str, instance: str, load: dict) -> dict:
    return {"service": service, "instance": instance, "load": load}


def test_workers_show_blocks_per_peer_and_lending_costs_per_step():
    debtor = worker_load_to_report(
        WorkerLoad(
            borrowed_blocks={"w1": 3, "w2": 5}, remote_attention_s=0.5, remote_attention_calls=40,
            remote_bytes_sent=4096 * 20, remote_bytes_received=2048 * 20, decode_steps=20,
        )
    )  # fmt: skip
    debtor["kv_overflow"] = "borrow"  # beside WorkerLoad's fields, as the worker's heartbeat has it
    debtor["lending_lane"] = "shared-memory"
    creditor = worker_load_to_report(WorkerLoad(lent_blocks={"w0": 3}, lent_attention_s=0.25))
    creditor["kv_overflow"] = "preempt"
    table = distkv_table(
        [row("gpu_worker", "w0", debtor), row("gpu_worker", "w1", creditor), row("kv_manager", "k", {"x": 1})]
    )
    header, first, second = table.splitlines()
    assert header.split()[:4] == ["WORKER", "LENT", "TO", "BORROWED"]
    assert first.split() == [
        "w0",
        "-",
        "w1:3,w2:5",
        "0.500s/40",
        "calls",
        "25.00ms",
        "4.0KiB/2.0KiB",
        "0.000s",
        "borrow/shared-memory",
    ]
    assert second.split() == ["w1", "w0:3", "-", "0.000s/0", "calls", "-", "-", "0.250s", "preempt"]
    assert header.split()[-1] == "OVERFLOW"
    assert DISTKV_KEYS | set(POLICY_KEYS) <= debtor.keys()  # every key it takes out of LOAD is a heartbeat's


def test_a_worker_without_the_policy_key_shows_a_dash():
    (line,) = distkv_table([row("gpu_worker", "w0", worker_load_to_report(WorkerLoad()))]).splitlines()[1:]
    assert line.split()[-1] == "-"


def test_no_table_without_workers():
    assert distkv_table([row("gateway", "g", {"queue": 0})]) is None
    assert distkv_table([row("gpu_worker", "starting", {})]) is None
