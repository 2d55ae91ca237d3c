"""The kv_manager in a real gRPC server on loopback, fed by simulated workers' heartbeats in a
real etcd: suggestions, refusals, DGFM plans, bad input, and leader election between replicas."""

from __future__ import annotations

import sys

import grpc
import pytest
from grpc import aio
from prometheus_client import generate_latest

from mesh_api.v1 import kv_manager_pb2 as pb
from mesh_api.v1 import kv_manager_pb2_grpc
from services.kv_manager.config import KVManagerConfig
from services.kv_manager.service import KVManagerService
from services.runtime.rpc.server import ServiceHost, check_health, start_service

pytestmark = pytest.mark.integration

RPC_TIMEOUT_S = 60.0  # a deadline on each call, only against hangs


class Replica:
    def __init__(self, host: ServiceHost):
        self.host = host
        self.instance_id = host.instance_id
        self.channel = aio.insecure_channel(host.address)
        self.stub = kv_manager_pb2_grpc.KVManagerStub(self.channel)

    async def ledger(self) -> pb.LedgerResponse:
        return await self.stub.Ledger(pb.LedgerRequest(), timeout=RPC_TIMEOUT_S)

    async def workers(self) -> dict[str, pb.LedgerEntry]:
        return {w.worker_id: w for w in (await self.ledger()).workers}

    async def suggest(self, debtor_id: str, blocks: int) -> list[str]:
        reply = await self.stub.SuggestCreditors(
            pb.SuggestCreditorsRequest(debtor_id=debtor_id, blocks=blocks), timeout=RPC_TIMEOUT_S
        )
        return [c.worker_id for c in reply.candidates]

    async def refused(self, call) -> aio.AioRpcError:
        with pytest.raises(aio.AioRpcError) as err:
            await call
        return err.value


@pytest.fixture
async def kv_managers(etcd):
    started: list[Replica] = []

    async def start(instance_id: str, dgfm_interval_s: float = 0) -> Replica:
        config = KVManagerConfig(
            etcd_endpoints=etcd.endpoint,
            lease_ttl_s=2,
            grace_s=0.5,
            instance_id=instance_id,
            resort_interval_s=0,
            dgfm_interval_s=dgfm_interval_s,  # 0: DGFM only when a test asks (Defragment)
        )
        replica = Replica(await start_service(KVManagerService(config), config))
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.channel.close()
        await replica.host.shutdown()


async def test_suggestions_follow_the_heartbeats(kv_managers, workers, poll):
    kv = await kv_managers("kv-a")
    await workers("debtor", free_blocks=0, total_blocks=64, topology="rack1")
    await workers("near", free_blocks=10, total_blocks=64, topology="rack1")
    far = await workers("far", free_blocks=50, total_blocks=64, topology="rack2")
    await workers("full", free_blocks=0, total_blocks=64, topology="rack1")
    listed = await poll(kv.workers, lambda w: len(w) == 4, "four workers in the ledger")
    assert listed["near"].lendable_blocks == 10 and listed["far"].topology == "rack2"
    assert await check_health(kv.host.address, "loramesh.v1.KVManager") == "SERVING"

    reply = await kv.stub.SuggestCreditors(pb.SuggestCreditorsRequest(debtor_id="debtor", blocks=8))
    assert [(c.worker_id, c.same_topology, c.lendable_blocks) for c in reply.candidates] == [
        ("near", True, 10),
        ("far", False, 50),
    ]
    assert reply.candidates[1].address == far.address

    # far fills up: the next heartbeat takes it out of the suggestions.
    far.load.free_blocks = 0
    await poll(kv.workers, lambda w: w["far"].free_blocks == 0, "far's new heartbeat")
    assert await kv.suggest("debtor", 8) == ["near"]
    # far's process goes away: its row goes with it.
    await far.registration.stop()
    await poll(kv.workers, lambda w: "far" not in w, "far gone from the ledger")


async def test_a_refusal_holds_until_the_creditors_next_heartbeat(kv_managers, workers, poll):
    kv = await kv_managers("kv-a")
    await workers("debtor", free_blocks=0, topology="r")
    lender = await workers("lender", load_interval_s=3600, free_blocks=9, topology="r")
    await poll(kv.workers, lambda w: len(w) == 2, "two workers in the ledger")
    assert await kv.suggest("debtor", 4) == ["lender"]

    await kv.stub.ReportRefusal(pb.ReportRefusalRequest(creditor_id="lender", debtor_id="debtor"))
    assert (await kv.workers())["lender"].refused
    error = await kv.refused(kv.suggest("debtor", 4))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no worker other than 'debtor'" in error.details()
    assert any(k == "retry-after-s" for k, _ in error.trailing_metadata())

    await lender.registration._write_load()  # the creditor's next heartbeat, now rather than in an hour
    await poll(kv.workers, lambda w: not w["lender"].refused, "refusal cleared")
    assert await kv.suggest("debtor", 4) == ["lender"]


async def test_bad_input_gets_a_clear_status(kv_managers, workers, poll):
    kv = await kv_managers("kv-a")
    await workers("debtor", free_blocks=0)
    await workers("lender", free_blocks=5)
    await poll(kv.workers, lambda w: len(w) == 2, "two workers in the ledger")
    cases = [
        (kv.suggest("debtor", 0), grpc.StatusCode.INVALID_ARGUMENT, "blocks >= 1, got 0"),
        (kv.suggest("", 3), grpc.StatusCode.INVALID_ARGUMENT, "debtor_id"),
        (kv.suggest("ghost", 3), grpc.StatusCode.NOT_FOUND, "debtor 'ghost' is not in the ledger"),
        (
            kv.stub.ReportRefusal(pb.ReportRefusalRequest(creditor_id="ghost")),
            grpc.StatusCode.NOT_FOUND,
            "creditor 'ghost' is not in the ledger",
        ),
        (kv.stub.ReportRefusal(pb.ReportRefusalRequest()), grpc.StatusCode.INVALID_ARGUMENT, "creditor_id"),
    ]
    for call, code, message in cases:
        error = await kv.refused(call)
        assert (error.code(), message in error.details()) == (code, True), error.details()
    assert await kv.suggest("debtor", 3) == ["lender"]  # still serving


async def test_dgfm_plans_the_swaps_of_a_three_cycle(kv_managers, workers, poll):
    kv = await kv_managers("kv-a")
    # a's KV on b (10), b's on c (6), c's on a (8): a creditor reports what it lends to whom.
    await workers("a", free_blocks=1, lent_blocks={"c": 8})
    await workers("b", free_blocks=1, lent_blocks={"a": 10})
    await workers("c", free_blocks=1, lent_blocks={"b": 6, "gone": 3})
    await poll(kv.workers, lambda w: len(w) == 3, "three workers in the ledger")
    plan = await kv.stub.PlanDefragmentation(pb.PlanDefragmentationRequest())
    assert [(list(s.cycle), s.blocks) for s in plan.swaps] == [(["a", "b", "c"], 6)]
    assert [(r.owner_id, r.holder_id, r.blocks) for r in plan.swaps[0].recalls] == [
        ("a", "b", 6),
        ("b", "c", 6),
        ("c", "a", 6),
    ]
    assert list(plan.frozen_workers) == ["a", "b", "c"] and plan.blocks_moved == 18
    assert (plan.remote_blocks_before, plan.remote_blocks_after) == (24, 6)
    # Above the smallest debt nothing is worth swapping.
    plan = await kv.stub.PlanDefragmentation(pb.PlanDefragmentationRequest(min_swap_blocks=7))
    assert not plan.swaps and plan.remote_blocks_after == 24
    metrics = generate_latest(kv.host.metrics.registry).decode()
    assert "loramesh_kv_manager_dgfm_swaps_planned 1.0" in metrics
    assert "loramesh_kv_manager_lent_blocks 27.0" in metrics


async def test_defragment_stops_at_a_worker_it_cannot_reach_and_says_which(kv_managers, workers, poll):
    """The simulated workers have no Worker server: the first recall of the cycle (a's stage-out,
    no pool having room) cannot reach a, so the run stops there, reported, nothing counted."""
    kv = await kv_managers("kv-a")
    await workers("a", free_blocks=1, lent_blocks={"c": 8})
    await workers("b", free_blocks=1, lent_blocks={"a": 10})
    await workers("c", free_blocks=1, lent_blocks={"b": 6})
    await poll(kv.workers, lambda w: len(w) == 3, "three workers in the ledger")
    reply = await kv.stub.Defragment(pb.DefragmentRequest(), timeout=RPC_TIMEOUT_S)
    assert [(list(s.cycle), s.blocks) for s in reply.plan.swaps] == [(["a", "b", "c"], 6)]
    assert (reply.swaps_done, reply.blocks_moved) == (0, 0)
    assert (reply.failed_worker, reply.error_code) == ("a", "UNAVAILABLE")
    assert "worker a (127.0.0.1:" in reply.error and "StageOutBlocks" in reply.error
    ledger = await kv.ledger()
    assert (ledger.dgfm_swaps_total, ledger.dgfm_blocks_moved_total) == (0, 0)
    metrics = generate_latest(kv.host.metrics.registry).decode()
    assert "loramesh_kv_manager_dgfm_swaps_total 0.0" in metrics
    assert "loramesh_kv_manager_dgfm_runs_failed_total 1.0" in metrics
    # Below the threshold there is nothing to do, and nothing fails.
    reply = await kv.stub.Defragment(pb.DefragmentRequest(min_swap_blocks=7), timeout=RPC_TIMEOUT_S)
    assert not reply.plan.swaps and not reply.failed_worker and reply.swaps_done == 0


async def test_the_leader_runs_dgfm_periodically_once_the_heartbeats_follow_the_last_run(
    kv_managers, workers, poll
):
    """Each periodic run fails (the simulated workers have no Worker server) and is counted; the
    next one starts once the cycle's workers have sent heartbeats since (every 0.2 s here)."""
    kv = await kv_managers("kv-a", dgfm_interval_s=0.05)
    await workers("a", free_blocks=0, lent_blocks={"c": 8})
    await workers("b", free_blocks=0, lent_blocks={"a": 10})
    await workers("c", free_blocks=0, lent_blocks={"b": 6})
    await poll(
        lambda: _async(kv.host.service.load_report),
        lambda report: report["dgfm_runs_failed_total"] >= 2,
        "two periodic DGFM runs",
    )
    assert kv.host.service.defragmenter.swaps_total == 0


async def _async(fn):
    return fn()


async def test_one_replica_leads_and_the_standby_takes_over(kv_managers, workers, poll):
    a = await kv_managers("kv-a")
    b = await kv_managers("kv-b")
    await workers("debtor", free_blocks=0)
    await workers("lender", free_blocks=5)
    term_a = a.host.service.election.term
    for replica in (a, b):  # both ledgers are fed; both know who leads, under which term
        await poll(replica.workers, lambda w: len(w) == 2, f"{replica.instance_id} ledger")
        ledger = await replica.ledger()
        assert (ledger.leader_id, ledger.leader_term) == ("kv-a", term_a) and term_a > 0
    assert await a.suggest("debtor", 2) == ["lender"]

    for call in (b.suggest("debtor", 2), b.stub.Defragment(pb.DefragmentRequest(), timeout=RPC_TIMEOUT_S)):
        error = await b.refused(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "kv_manager kv-b is a standby; the leader is kv-a at " + a.host.address in error.details()

    await a.host.shutdown()
    ledger = await poll(b.ledger, lambda r: r.leader_id == "kv-b", "kv-b leads")
    assert ledger.leader_term > term_a  # a later leader, a larger term
    assert await b.suggest("debtor", 2) == ["lender"]
    report = b.host.service.load_report()
    assert (report["leader"], report["term"]) == (1, ledger.leader_term)


async def test_the_service_refuses_to_start_without_etcd():
    config = KVManagerConfig()
    service = KVManagerService(config)
    assert config.instance_id.startswith("kv_manager-")  # pinned: the leader key names it
    with pytest.raises(ValueError, match="--etcd-endpoints"):
        await service.start()


def test_the_entry_point_documents_its_flags():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "services.kv_manager", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--min-swap-blocks" in out and "DGFM" in out
