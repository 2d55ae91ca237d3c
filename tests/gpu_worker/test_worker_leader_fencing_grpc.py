"""A deposed kv_manager leader is fenced by term (issue 49): two kv_managers' elections on a real
etcd and their write path (GrpcRecallWorkers) against a real Worker server whose engine holds a
borrowed request (the DGFM test mesh, tiny Llama). kv-a leads and stages blocks; its key is taken
from it behind its back (its election rounds are held, so it still thinks it leads) and kv-b
leads and stages; a write of kv-a's, confirmed before the change and delivered after it, is
refused naming both terms, and kv-a steps down until it wins again under a newer term."""

from __future__ import annotations

import asyncio

import pytest
from grpc import aio
from support.dgfm_cycle import CycleMesh, SteppedOnCall, build_full_cycle
from support.held_election import HeldRounds, revoke_key_lease
from support.polling import poll_until
from support.worker_server import serve_worker

from mesh_api.v1 import worker_pb2, worker_pb2_grpc
from services.kv_manager.worker_recalls import GrpcRecallWorkers, LeaderTenure
from services.runtime.errors import StaleLeaderTerm
from services.runtime.etcd.leader_election import LeaderElection

pytestmark = pytest.mark.integration

RPC_TIMEOUT_S = 60.0  # only against hangs


class ConfirmedBefore:
    """A leader's tenure as it stood when a write was confirmed, before another took over; the
    write is delivered after (a pause or a slow network between the two)."""

    def __init__(self, election: LeaderElection, term: int):
        self.election = election
        self.term = term
        self.instance_id = election.instance_id

    async def confirm(self) -> int:
        return self.term

    def step_down(self, term: int, why: str) -> None:
        self.election.step_down(term, why)


async def stage_round_trip(address: str, tenure: LeaderTenure) -> None:
    """One block of w0's staged out of w1 and back in: two leader writes to w0."""
    workers = GrpcRecallWorkers({"w0": address}, tenure, RPC_TIMEOUT_S)
    try:
        stage_id = await workers.stage_out("w0", "w1", 1)
        await workers.stage_in("w0", stage_id)
    finally:
        await workers.close()


async def test_a_deposed_leaders_write_is_refused_and_it_steps_down_until_it_wins_again(
    tiny_llama, membership_config, etcd
):
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)  # w0's request has 2 blocks on w1
    SteppedOnCall(mesh.engines["w0"])
    server, address = await serve_worker(mesh.engines["w0"])
    channel = aio.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    held = HeldRounds()
    a = LeaderElection(membership_config, "kv_manager", "kv-a", sleep=held)
    b = LeaderElection(membership_config, "kv_manager", "kv-b")

    async def fenced() -> tuple[int, int, int]:
        stats = await stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=RPC_TIMEOUT_S)
        return stats.kv_manager_term, stats.leader_writes_accepted, stats.leader_writes_refused

    try:
        await a.start()
        await a.wait_decided()
        term_a = a.term
        assert a.is_leader and term_a > 0
        await stage_round_trip(address, a)
        assert await fenced() == (term_a, 2, 0)

        await revoke_key_lease(etcd.endpoint, a.key)
        await b.start()
        await b.wait_decided()
        term_b = b.term
        assert b.is_leader and term_b > term_a
        assert a.is_leader and a.term == term_a  # its rounds are held: it still thinks it leads
        await stage_round_trip(address, b)
        assert await fenced() == (term_b, 4, 0)

        with pytest.raises(StaleLeaderTerm) as refused:
            await stage_round_trip(address, ConfirmedBefore(a, term_a))
        assert refused.value.current_term == term_b
        assert (
            f"StageOutBlocks from kv_manager kv-a under term {term_a} refused: this worker has "
            f"taken term {term_b} (kv_manager kv-b); kv-a is not the leader"
        ) in refused.value.message
        assert not a.is_leader and a.term == 0  # stepped down on the refusal
        assert await fenced() == (term_b, 4, 1)
        assert not mesh.engines["w0"].recalls.frozen  # the refused stage-out never reached it

        # Down until it wins again: its rounds go on and see kv-b lead; once kv-b goes, kv-a
        # takes the key again under a newer term, which the worker takes.
        held.released.set()
        await poll_until(lambda: asyncio.sleep(0, a), lambda e: e.leader_id == "kv-b", "kv-a sees kv-b")
        await b.stop()
        await poll_until(lambda: asyncio.sleep(0, a), lambda e: e.is_leader, "kv-a leads again")
        assert a.term > term_b
        await stage_round_trip(address, a)
        assert await fenced() == (a.term, 6, 1)
    finally:
        await channel.close()
        await server.stop(None)
        await a.stop()
        await b.stop()
