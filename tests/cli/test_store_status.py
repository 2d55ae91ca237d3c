"""``loramesh status`` on adapter store replicas: each one's address, health, catalog state and
adapter count, the blob tier they share, and a warning when they do not share one; the
supervisor of `up` restarts a dead replica alone."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import SimpleNamespace

from loramesh_cli import mesh_status
from loramesh_cli.restart_policy import RestartPolicy
from loramesh_cli.store_status import store_table
from loramesh_cli.supervisor import Supervisor


def member(service: str, instance: str, load: dict, address: str = "127.0.0.1:1") -> dict:
    return {
        "service": service,
        "instance": instance,
        "address": address,
        "health": "SERVING",
        "uptime_s": 3.0,
        "load": load,
    }


def store(instance: str, address: str, blob_store: str, catalog: str = "ok", adapters: int = 2) -> dict:
    load = {"catalog": catalog, "blob_store": blob_store, "adapters": adapters, "ram_bytes": 0}
    return member("adapter_store", instance, load, address)


def test_every_replica_is_listed_under_the_blob_tier_they_share():
    rows = [
        store("adapter_store", "127.0.0.1:5001", "s3://loras/mesh (disk cache /s/adapter_store/blob_cache)"),
        store("adapter_store-1", "127.0.0.1:5002", "s3://loras/mesh (disk cache /s/adapter_store-1/blob_cache)",
              catalog="etcd unreachable: retrying", adapters=0),
        member("gateway", "gateway", {"streams": 1}),
    ]  # fmt: skip
    title, header, first, second = store_table(rows).splitlines()
    assert title == "Adapter stores (2 replicas; blob store s3://loras/mesh)"
    assert header.split() == ["STORE", "ADDRESS", "HEALTH", "CATALOG", "ADAPTERS"]
    assert first.split() == ["adapter_store", "127.0.0.1:5001", "SERVING", "ok", "2"]
    assert second.split()[:4] == ["adapter_store-1", "127.0.0.1:5002", "SERVING", "etcd"]
    assert second.split()[-1] == "0"
    assert store_table([member("gateway", "gateway", {})]) is None


def test_replicas_on_different_blob_tiers_are_a_warning_naming_each():
    rows = [
        store("adapter_store", "127.0.0.1:5001", "file:///a"),
        store("adapter_store-1", "127.0.0.1:5002", "file:///b"),
        # Not ready yet: no load report beyond readiness.
        member("adapter_store", "adapter_store-2", {"ready": False}),
    ]
    title, *_, last = store_table(rows).splitlines()
    assert "3 replicas" in title and "WARNING" in title
    assert "adapter_store: file:///a; adapter_store-1: file:///b" in title
    assert last.split() == ["adapter_store-2", "127.0.0.1:1", "SERVING", "-", "-"]


def test_status_prints_the_store_table_and_keeps_the_blob_tier_out_of_load(monkeypatch, capsys):
    rows = [store("adapter_store", "127.0.0.1:5001", "file:///s/adapter_store"),
            store("adapter_store-1", "127.0.0.1:5002", "file:///s/adapter_store")]  # fmt: skip

    async def collect(endpoint, tls):
        return [dict(r) for r in rows]

    monkeypatch.setattr(mesh_status, "collect_status", collect)
    args = SimpleNamespace(etcd="127.0.0.1:2379", json=False, state_dir="unused")
    monkeypatch.setattr(mesh_status, "cli_tls", lambda _: None)
    assert mesh_status.cmd_status(args) == 0
    out = capsys.readouterr().out
    members, stores = out.split("\n\n")[:2]
    assert "catalog=" not in members and "blob_store=" not in members and "adapters=2" in members
    assert stores.splitlines()[0] == "Adapter stores (2 replicas; blob store file:///s/adapter_store)"
    args.json = True
    assert mesh_status.cmd_status(args) == 0
    assert [r["load"]["catalog"] for r in json.loads(capsys.readouterr().out)] == ["ok", "ok"]


@dataclass
class FakeProcess:
    """A supervised unit whose death the test decides."""

    name: str
    launches: int = 0
    dead: bool = False

    def launch(self) -> None:
        self.launches += 1
        self.dead = False

    def exit_code(self) -> int | None:
        return -9 if self.dead else None

    def pid(self) -> int:
        return 100 + self.launches

    def stop(self) -> None:
        self.dead = True


def test_the_supervisor_restarts_a_dead_store_replica_alone():
    now = [1000.0]
    units = [FakeProcess("adapter_store"), FakeProcess("adapter_store-1"), FakeProcess("gateway")]
    supervisor = Supervisor(units, RestartPolicy(initial_backoff_s=1.0), clock=lambda: now[0])
    for unit in units:
        unit.launch()
        supervisor.launched(unit)
    units[1].dead = True
    asyncio.run(supervisor.check())  # the exit seen
    now[0] += 1.0
    asyncio.run(supervisor.check())  # the backoff over: relaunched
    assert [u.launches for u in units] == [1, 2, 1]
    assert [supervisor.trackers[u.name].restarts for u in units] == [0, 1, 0]
