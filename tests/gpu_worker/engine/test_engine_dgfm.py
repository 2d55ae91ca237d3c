"""DGFM applied by three engines in one process (tiny random Llama, fp32): a 3-cycle of debts
with every pool full (w0's request has blocks on w1, w1's on w2, w2's on w0) is planned from the
engines' own accounting and applied through each engine's ``between_steps`` (w0 stages, since no
pool has room). Remote blocks drop by the planned amount, every block is accounted for, and each
request's greedy tokens and logits equal an undisturbed run on one big pool. The same cycle is
then cancelled over gRPC: the kv_manager's Defragmenter against three Worker servers."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from grpc import aio
from support.in_process_transport import InProcessTransport
from support.worker_server import serve_worker

from mesh_api.v1 import worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.kv_manager.defragmenter import Defragmenter
from services.kv_manager.dgfm import CycleSwap, DgfmConfig, plan_defragmentation
from services.kv_manager.dgfm_execution import StepKind, apply_plan, apply_swap
from services.kv_manager.ledger import DebtLedger, WorkerBlocks
from services.kv_manager.worker_recalls import GrpcRecallWorkers
from services.runtime.errors import FailedPrecondition, ResourceExhausted

BLOCK = 8
POOL_MIB = 1 / 32
"""Tiny Llama, fp32: a page is 8 tokens × kv_dim 32 × K,V × 4 B = 2 KiB; 16 pages = 8 blocks."""
POOL_BLOCKS = 8
CAP = 6
CREDITOR_OF = {"w0": "w1", "w1": "w2", "w2": "w0"}
"""Each worker borrows from one other only: the debts form the cycle w0 -> w1 -> w2 -> w0."""
PROMPT = 57
"""57 tokens = 8 blocks: 6 in the debtor's pool (2 of its 8 hold another's loan), 2 borrowed."""
MAX_TOKENS = 8
"""57 + 8 tokens fit the 8 blocks (the last token's KV is never written)."""


class CycleMesh:
    """Three borrowing engines; ``w`` borrows only from ``CREDITOR_OF[w]``."""

    def __init__(self, tiny_llama):
        self.engines: dict[str, Engine] = {}
        self.transports: dict[str, InProcessTransport] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        for name in CREDITOR_OF:
            model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
            config = EngineConfig(
                pool_mib=POOL_MIB,
                kv_block_tokens=BLOCK,
                worker_id=name,
                max_lent_blocks=CAP,
                kv_overflow="borrow",
                # The cycle is built block by block: no prompt block may stay cached after its
                # request, where a lender's free pages are counted.
                prefix_cache=False,
            )
            engine = local_engine(
                model,
                config,
                creditors=self,
                connect=lambda creditor, _: self.transports[creditor],
                on_logits=lambda request_id, row: self.logits.setdefault(request_id, []).append(row),
            )
            assert engine.rm.local.free_blocks == POOL_BLOCKS
            self.engines[name] = engine
            self.transports[name] = InProcessTransport(name, engine.rm.lender)

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        lender = self.engines[CREDITOR_OF[debtor]].rm
        lendable = min(CAP - lender.lender.lent_blocks, lender.local.free_blocks)
        if lendable < 1:
            raise ResourceExhausted(f"{CREDITOR_OF[debtor]} cannot lend")
        return [Candidate(CREDITOR_OF[debtor], CREDITOR_OF[debtor], lendable)]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        pass

    def submit(self, worker: str, request: GenerationRequest) -> None:
        def sink(event):
            if event.token_id is not None:
                self.tokens.setdefault(event.request_id, []).append(event.token_id)
            if event.finish_reason is not None:
                self.finish[event.request_id] = event.finish_reason

        self.engines[worker].submit(request, sink)

    def debts(self) -> dict[tuple[str, str], int]:
        """What the ledger would hold: each creditor's loans, as its heartbeat reports them."""
        return {
            (debtor, creditor): blocks
            for creditor, engine in self.engines.items()
            for debtor, blocks in engine.rm.accounting().lent_blocks.items()
        }

    def free_blocks(self) -> dict[str, int]:
        return {name: engine.rm.local.free_blocks for name, engine in self.engines.items()}

    def remote_blocks(self) -> int:
        return sum(sum(e.rm.accounting().borrowed_blocks.values()) for e in self.engines.values())

    def run_to_end(self) -> None:
        while any(e.has_work() for e in self.engines.values()):
            for engine in self.engines.values():
                if engine.has_work():
                    engine.step()


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


def request(worker: str) -> GenerationRequest:
    offset = int(worker[1:])
    prompt = tuple((7 * j + 13 * offset + 3) % 250 + 1 for j in range(PROMPT))
    return GenerationRequest(f"r-{worker}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


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


def build_full_cycle(mesh: CycleMesh) -> None:
    """Every pool full, each holding 2 blocks of its predecessor's request.

    w1 runs a 2-block filler beside its request, so its request borrows 2 blocks from w2; the
    filler ends, and w2's request (6 blocks left at w2) borrows 2 from w0, whose request then
    takes w0's 6 free blocks and borrows 2 from w1, into the filler's old slots.
    """
    filler = GenerationRequest("filler", tuple(range(1, 10)), SamplingParams(max_tokens=2, ignore_eos=True))
    mesh.submit("w1", filler)
    mesh.submit("w1", request("w1"))
    mesh.engines["w1"].step()  # both prefill; w1's request borrows 2 blocks from w2
    mesh.engines["w1"].step()  # the filler's second token ends it
    assert mesh.finish["filler"] is FinishReason.LENGTH
    for worker in ("w2", "w0"):
        mesh.submit(worker, request(worker))
        mesh.engines[worker].step()
    assert mesh.debts() == {("w0", "w1"): 2, ("w1", "w2"): 2, ("w2", "w0"): 2}
    assert mesh.free_blocks() == {"w0": 0, "w1": 0, "w2": 0}


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


class SteppedOnCall:
    """Steps ``engine`` once (on a thread of its own) for each call handed to ``between_steps``,
    as the engine thread would, without letting it decode on its own in between."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._hand_over = engine.between_steps
        engine.between_steps = self.between_steps

    def between_steps(self, fn):
        future = self._hand_over(fn)
        threading.Thread(target=self._step, daemon=True).start()
        return future

    def _step(self) -> None:
        with self._lock:
            self.engine.step()


async def test_defragment_over_grpc_drives_real_worker_servers_through_the_staged_cycle(tiny_llama):
    """The kv_manager's Defragmenter and GrpcRecallWorkers against three Worker gRPC servers:
    the plan comes from a ledger of the workers' reports, the recalls travel as RPCs, and bad
    DGFM calls get a clear status while the worker keeps serving."""
    expected = {w: undisturbed(tiny_llama, request(w)) for w in CREDITOR_OF}
    mesh = CycleMesh(tiny_llama)
    build_full_cycle(mesh)
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
        defragmenter = Defragmenter(DgfmConfig(min_swap_blocks=2), lambda a: GrpcRecallWorkers(a, 60.0))
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
            cases = [
                (stub.RecallBlocks(worker_pb2.RecallBlocksRequest(holder="", blocks=1)), "INVALID_ARGUMENT", "holder is empty"),
                (stub.RecallBlocks(worker_pb2.RecallBlocksRequest(holder="w1", blocks=0)), "INVALID_ARGUMENT", "at least one block"),
                (stub.StageOutBlocks(worker_pb2.StageOutBlocksRequest(holder="w2", blocks=1)), "FAILED_PRECONDITION", "holds 0 of its blocks on w2"),
                (stub.StageInBlocks(worker_pb2.StageInBlocksRequest(stage_id=7)), "NOT_FOUND", "stage 7 is not open"),
            ]  # fmt: skip
            for call, code, message in cases:
                with pytest.raises(aio.AioRpcError) as error:
                    await call
                assert (error.value.code().name, message in error.value.details()) == (code, True)
            assert (await stub.Stats(worker_pb2.WorkerStatsRequest())).dgfm_recalls == 1
    finally:
        for server in servers:
            await server.stop(None)
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
