"""DGFM applied by three engines in one process (tiny random Llama, fp32): a 3-cycle of debts
with every pool full (w0's request has blocks on w1, w1's on w2, w2's on w0) is planned from the
engines' own accounting and applied through each engine's ``between_steps`` (w0 stages, since no
pool has room). Remote blocks drop by the planned amount, every block is accounted for, and each
request's greedy tokens and logits equal an undisturbed run on one big pool. The same cycle is
then cancelled over gRPC: the kv_manager's Defragmenter against three Worker servers."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from grpc import aio
from support.dgfm_cycle import (
    BLOCK,
    CREDITOR_OF,
    POOL_BLOCKS,
    CycleMesh,
    SteppedOnCall,
    build_full_cycle,
    request,
)
from support.worker_server import serve_worker

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.model.llama import LlamaModel
from services.kv_manager.defragmenter import Defragmenter
from services.kv_manager.dgfm import CycleSwap, DgfmConfig, plan_defragmentation
from services.kv_manager.dgfm_execution import StepKind, apply_plan, apply_swap
from services.kv_manager.ledger import DebtLedger, WorkerBlocks
from services.kv_manager.worker_recalls import GrpcRecallWorkers
from services.runtime.errors import FailedPrecondition, ResourceExhausted
from services.runtime.etcd.leader_election import LeaderElection


class EngineRecalls:
    """The driver's ``RecallWorkers`` over in-process engines: each call is handed to the
    engine's thread (here: the test's) and applied by its next step."""

    def __init__(self, mesh: CycleMesh):
        self.mesh = mesh
        self.calls: list[tuple[str, str]] = []

    def _between_steps(self, worker: str, what: str, fn):
        self.calls.append((what, worker))
        engine = self.mesh.engines[worker]
        future = engine.between_steps(fn)
        engine.step()
        return future.result()

    async def recall(self, owner_id: str, holder_id: str, blocks: int) -> int:
        recalls = self.mesh.engines[owner_id].recalls
        return self._between_steps(owner_id, "recall", lambda: recalls.recall(holder_id, blocks))

    async def stage_out(self, owner_id: str, holder_id: str, blocks: int) -> int:
        recalls = self.mesh.engines[owner_id].recalls
        return self._between_steps(owner_id, "stage_out", lambda: recalls.stage_out(holder_id, blocks))

    async def stage_in(self, owner_id: str, stage_id: int) -> int:
        recalls = self.mesh.engines[owner_id].recalls
        return self._between_steps(owner_id, "stage_in", lambda: recalls.stage_in(stage_id))


def undisturbed(tiny_llama, spec: GenerationRequest) -> tuple[list[int], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK), on_logits=lambda _, row: logits.append(row)
    )
    tokens: list[int] = []
    engine.submit(spec, lambda e: tokens.append(e.token_id) if e.token_id is not None else None)
    while engine.has_work():
        engine.step()
    return tokens, logits


def assert_every_block_accounted_for(mesh: CycleMesh, in_use: dict[str, int]) -> None:
    for name, engine in mesh.engines.items():
        accounting = engine.rm.accounting()
        assert accounting.local_blocks == in_use[name], name
        assert (
            accounting.local_blocks + sum(accounting.lent_blocks.values()) + accounting.free_blocks
            == POOL_BLOCKS
        )
        assert engine.pool.usage().kv_pages == (POOL_BLOCKS - accounting.free_blocks) * 2, name


async def test_a_full_3_cycle_is_cancelled_by_staged_recalls_and_outputs_do_not_change(tiny_llama):
    expected = {w: undisturbed(tiny_llama, request(w)) for w in CREDITOR_OF}
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
    assert mesh.remote_blocks() == 6

    plan = plan_defragmentation(mesh.debts(), DgfmConfig(min_swap_blocks=2))
    assert plan.swap_count == 1 and plan.swaps[0] == CycleSwap(("w0", "w1", "w2"), 2)
    workers = EngineRecalls(mesh)
    outcome = await apply_plan(plan, mesh.free_blocks(), workers)

    assert outcome.failure is None and outcome.swaps_done == plan.swap_count == 1
    assert outcome.blocks_moved == plan.blocks_moved == 6
    assert workers.calls == [("stage_out", "w0"), ("recall", "w1"), ("recall", "w2"), ("stage_in", "w0")]
    assert mesh.remote_blocks() == plan.remote_blocks_after == 0
    assert mesh.debts() == {} and mesh.free_blocks() == {"w0": 0, "w1": 0, "w2": 0}
    assert_every_block_accounted_for(mesh, {w: POOL_BLOCKS for w in CREDITOR_OF})
    assert {w: e.recalls.blocks_recalled for w, e in mesh.engines.items()} == {"w0": 2, "w1": 2, "w2": 2}
    assert not any(e.recalls.frozen for e in mesh.engines.values())

    mesh.run_to_end()
    for worker, (tokens, logits) in expected.items():
        request_id = f"r-{worker}"
        assert mesh.finish[request_id] is FinishReason.LENGTH
        assert mesh.tokens[request_id] == tokens, worker
        got = mesh.logits[request_id]
        assert len(got) == len(logits)
        for step, (row, want) in enumerate(zip(got, logits)):
            assert torch.allclose(row, want, atol=1e-3, rtol=0), (
                f"{worker} step {step}: {(row - want).abs().max()}"
            )
    assert all(e.preemptions == 0 for e in mesh.engines.values())
    assert_every_block_accounted_for(mesh, {w: 0 for w in CREDITOR_OF})
    assert mesh.free_blocks() == {w: POOL_BLOCKS for w in CREDITOR_OF}


async def test_a_cycle_that_fails_midway_closes_its_stage_and_leaves_every_table_consistent(tiny_llama):
    """w2 takes the 2 blocks w0's stage-out freed at w1 (a loan between two heartbeats), so w1's
    recall finds no room: the swap stops there with RESOURCE_EXHAUSTED and w0 closes its stage.
    No pool has room for the staged blocks (w0's own slots were never freed, w1 is full again),
    so w0's request is recomputed: nothing leaks and the outputs do not change."""
    expected = {w: undisturbed(tiny_llama, request(w)) for w in CREDITOR_OF}
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
    workers = EngineRecalls(mesh)
    stage_out = workers.stage_out

    async def stage_out_then_lose_the_room(owner_id, holder_id, blocks):
        stage_id = await stage_out(owner_id, holder_id, blocks)
        mesh.engines["w2"].rm.connect("w1", mesh.transports["w1"])
        mesh.intruder = mesh.engines["w2"].rm.borrow("w1", blocks)
        return stage_id

    workers.stage_out = stage_out_then_lose_the_room
    outcome = await apply_swap(CycleSwap(("w0", "w1", "w2"), 2), mesh.free_blocks(), workers)

    assert not outcome.done and outcome.failed_step.kind is StepKind.RECALL
    assert outcome.failed_step.owner_id == "w1" and isinstance(outcome.error, ResourceExhausted)
    assert workers.calls == [("stage_out", "w0"), ("recall", "w1"), ("stage_in", "w0")]
    assert outcome.blocks_moved == 0  # w0's blocks went back to a creditor, not home
    assert not mesh.engines["w0"].recalls.frozen
    assert mesh.engines["w0"].preemptions == 1 and mesh.debts() == {
        ("w1", "w2"): 2,
        ("w2", "w0"): 2,
        ("w2", "w1"): 2,
    }
    mesh.engines["w2"].rm.free(mesh.intruder)  # the loan ends
    mesh.run_to_end()
    for worker, (tokens, logits) in expected.items():
        assert mesh.tokens[f"r-{worker}"] == tokens, worker
        assert len(mesh.logits[f"r-{worker}"]) == len(logits)
        for row, want in zip(mesh.logits[f"r-{worker}"], logits):
            assert torch.allclose(row, want, atol=1e-3, rtol=0)
    assert_every_block_accounted_for(mesh, {w: 0 for w in CREDITOR_OF})
    assert mesh.free_blocks() == {w: POOL_BLOCKS for w in CREDITOR_OF}


def test_a_recall_needs_the_blocks_and_the_room_and_changes_nothing_when_refused(tiny_llama):
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
    recalls = mesh.engines["w0"].recalls
    before = mesh.debts()
    with pytest.raises(FailedPrecondition, match="holds 2 of its blocks on w1, fewer than the 3"):
        recalls.recall("w1", 3)
    with pytest.raises(ResourceExhausted, match="no room to recall 2 blocks from w1"):
        recalls.recall("w1", 2)
    with pytest.raises(FailedPrecondition, match="holds 0 of its blocks on w2"):
        recalls.stage_out("w2", 1)
    assert mesh.debts() == before and not recalls.frozen and recalls.recalls == 0


@pytest.mark.integration
async def test_defragment_over_grpc_drives_real_worker_servers_through_the_staged_cycle(
    tiny_llama, membership_config
):
    """The kv_manager's Defragmenter and GrpcRecallWorkers against three Worker gRPC servers,
    under the term of a kv_manager leader elected in a real etcd: the plan comes from a ledger of
    the workers' reports, the recalls travel as RPCs carrying the term, and bad DGFM calls (one
    without a term too) get a clear status while the worker keeps serving."""
    expected = {w: undisturbed(tiny_llama, request(w)) for w in CREDITOR_OF}
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
    leader = LeaderElection(membership_config, "kv_manager", "kv-a")
    await leader.start()
    await leader.wait_decided()
    servers, addresses = [], {}
    for name, engine in mesh.engines.items():
        SteppedOnCall(engine)
        server, addresses[name] = await serve_worker(engine)
        servers.append(server)
    try:
        ledger = DebtLedger()
        ledger.replace(
            WorkerBlocks(
                name,
                addresses[name],
                free_blocks=engine.rm.local.free_blocks,
                total_blocks=POOL_BLOCKS,
                lent=engine.rm.accounting().lent_blocks,
                reported_at=1.0,
            )
            for name, engine in mesh.engines.items()
        )
        defragmenter = Defragmenter(
            DgfmConfig(min_swap_blocks=2), lambda a: GrpcRecallWorkers(a, leader, 60.0)
        )
        outcome = await defragmenter.run(ledger)
        assert outcome.failure is None and outcome.swaps_done == 1 and outcome.blocks_moved == 6
        assert (defragmenter.swaps_total, defragmenter.blocks_moved_total) == (1, 6)
        assert not defragmenter.settled(ledger)  # until the workers' next heartbeats
        ledger.replace(dataclasses.replace(row, reported_at=time.time() + 1) for row in ledger.rows())
        assert defragmenter.settled(ledger)
        assert mesh.remote_blocks() == 0 and mesh.debts() == {}
        assert_every_block_accounted_for(mesh, {w: POOL_BLOCKS for w in CREDITOR_OF})

        async with aio.insecure_channel(addresses["w0"]) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stats = await stub.Stats(worker_pb2.WorkerStatsRequest())
            assert (stats.dgfm_recalls, stats.dgfm_blocks_recalled) == (1, 2)
            # w0 staged out and in: two writes, taken under the leader's term.
            assert (stats.kv_manager_term, stats.leader_writes_accepted) == (leader.term, 2)
            term = types_pb2.LeaderTerm(term=leader.term, leader_id="kv-a")
            cases = [
                (stub.RecallBlocks(worker_pb2.RecallBlocksRequest(holder="", blocks=1, leader=term)), "INVALID_ARGUMENT", "holder is empty"),
                (stub.RecallBlocks(worker_pb2.RecallBlocksRequest(holder="w1", blocks=0, leader=term)), "INVALID_ARGUMENT", "at least one block"),
                (stub.StageOutBlocks(worker_pb2.StageOutBlocksRequest(holder="w2", blocks=1, leader=term)), "FAILED_PRECONDITION", "holds 0 of its blocks on w2"),
                (stub.StageInBlocks(worker_pb2.StageInBlocksRequest(stage_id=7, leader=term)), "NOT_FOUND", "stage 7 is not open"),
                (stub.RecallBlocks(worker_pb2.RecallBlocksRequest(holder="w1", blocks=1)), "FAILED_PRECONDITION", "without a leader term"),
            ]  # fmt: skip
            for call, code, message in cases:
                with pytest.raises(aio.AioRpcError) as error:
                    await call
                assert (error.value.code().name, message in error.value.details()) == (code, True)
            stats = await stub.Stats(worker_pb2.WorkerStatsRequest())
            assert (stats.dgfm_recalls, stats.leader_writes_accepted, stats.leader_writes_refused) == (
                1,
                6,
                1,
            )
    finally:
        for server in servers:
            await server.stop(None)
        await leader.stop()
    mesh.run_to_end()
    for worker, (tokens, _) in expected.items():
        assert mesh.tokens[f"r-{worker}"] == tokens, worker
    assert_every_block_accounted_for(mesh, {w: 0 for w in CREDITOR_OF})


def test_a_stage_its_kv_manager_never_closes_is_closed_by_the_engine(tiny_llama):
    """w0 stages its 2 blocks out of w1 and nobody calls stage_in: w0 does not step (its KV is
    in no pool) until the stage times out on its clock; then it closes the stage itself. Its
    pool is still full, so the blocks are borrowed back from w1, where room was freed."""
    expected_tokens, _ = undisturbed(tiny_llama, request("w0"))
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
    w0 = mesh.engines["w0"]
    now = [0.0]
    w0.recalls.clock = lambda: now[0]
    w0.recalls.stage_out("w1", 2)
    assert w0.recalls.frozen and mesh.debts() == {("w1", "w2"): 2, ("w2", "w0"): 2}
    tokens_so_far = len(mesh.tokens["r-w0"])
    w0.step()
    assert w0.recalls.frozen and len(mesh.tokens["r-w0"]) == tokens_so_far  # frozen: no decode
    now[0] = w0.recalls.stage_timeout_s
    w0.step()
    assert not w0.recalls.frozen and len(mesh.tokens["r-w0"]) == tokens_so_far + 1
    assert mesh.debts() == {("w0", "w1"): 2, ("w1", "w2"): 2, ("w2", "w0"): 2} and w0.recalls.recalls == 0
    mesh.run_to_end()
    assert mesh.tokens["r-w0"] == expected_tokens and w0.preemptions == 0
    assert_every_block_accounted_for(mesh, {w: 0 for w in CREDITOR_OF})
