"""DGFM across real processes (issue 28): three ``python -m services.gpu_worker`` processes with
small pools and ``--kv-overflow borrow``, a kv_manager and a real etcd. The workers' requests
borrow one after another until every pool is full and the debts form the cycle w0 -> w1 -> w2
-> w0 (w0's request has 2 blocks on w1, w1's on w2, w2's on w0); the kv_manager's Defragment
cancels it (w0 stages, since no pool has room: DistKV-LLM's recall and swap), the ledger then
holds no debt, every worker brought 2 blocks home, no block leaked, and every request's greedy
tokens and fp32 log-probabilities are those of one engine with a large pool.

Nothing races the machine's speed. Each worker's engine is gated (``support.step_gate``): it
takes only the steps the test allows and is held in between, still serving lending RPCs,
heartbeats and the DGFM calls handed to ``Engine.between_steps``. So the cycle is built step by
step (each borrow happens in one known step, from the creditor the ledger, checked beforehand,
makes the kv_manager suggest), it stays put while the test checks it and while DGFM moves
blocks (no request decodes meanwhile), and only then do the requests run to their end. The
kv_manager runs with ``--dgfm-interval-s 0``: DGFM only when the test calls Defragment. Waits
are for events (a ledger, a listed request, a gate's report), bounded by hang guards only.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from grpc import aio
from support.cli import COMMAND_TIMEOUT_S
from support.distkv_mesh import (
    assert_same_as_one_big_pool,
    every_block_back,
    generate,
    long_prompt,
    mesh_ready,
    start_mesh,
)
from support.polling import poll_until as until
from support.step_gate import StepGate

from mesh_api.v1 import kv_manager_pb2, kv_manager_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from services.runtime.etcd.membership import MembershipConfig, read_loads
from services.runtime.process.process import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.model]

W0, W1, W2 = WORKERS = ("gpu_worker-w0", "gpu_worker-w1", "gpu_worker-w2")
POOL_MIB = 6
"""SmolLM2-135M in fp32: a 16-token block is 30 layers × 24 KiB pages = 720 KiB, so a 6 MiB
pool holds 8 blocks (128 tokens)."""
POOL_BLOCKS = 8
LEND_CAPS = {W0: 3, W1: 2, W2: 4}
"""Chosen so that the kv_manager suggests the cycle's creditor each time (most lendable first):
w1 borrows from w2 (4 lendable) rather than w0 (3); w2 from w0 (3) rather than w1 (2 free);
w0 from w1, the only one with blocks left to lend."""
PROMPT_TOKENS, NEW_TOKENS = 113, 16
"""113 tokens fill 8 blocks; with 16 new tokens the KV never outgrows them (113 + 15 = 128)."""
FILLER_TOKENS = 17
"""w1's filler: 2 blocks, and 2 new tokens (its second ends it and frees the blocks)."""
SWAP_BLOCKS = 2
"""Each request borrows 2 blocks (8 needed, 6 free in its pool): the cycle's every debt."""
KV_MANAGER_FLAGS = (
    "--dgfm-interval-s", "0",  # DGFM only when the test calls Defragment
    "--min-swap-blocks", str(SWAP_BLOCKS),
    "--resort-interval-s", "0",  # suggestions ranked on the ledger as it is, never an older sort
)  # fmt: skip
WORKER_FLAGS = (
    "--quantization", "none",  # fp32 weights, as the reference engine's
    "--threads", "1",  # three workers on two cores
    "--lend-compute-share", "1",  # no compute cap: it counts wall time
)  # fmt: skip


async def listed(worker: ServiceProcess, count: int) -> None:
    """Until ``worker``'s engine has ``count`` requests (it takes new ones while held)."""
    async with aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await until(
            lambda: stub.ListRequests(worker_pb2.ListRequestsRequest()),
            lambda reply: len(reply.requests) == count,
            f"{count} request(s) handed to {worker.address}'s engine",
        )


async def worker_stats(worker: ServiceProcess) -> worker_pb2.WorkerStatsResponse:
    async with aio.insecure_channel(worker.address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.WorkerStatsRequest())


async def test_dgfm_cancels_a_debt_cycle_of_three_worker_processes_and_outputs_do_not_change(
    etcd, tmp_path, loaded
):
    text = long_prompt(loaded)
    prompts = {
        W0: text[0:PROMPT_TOKENS],
        W1: text[300 : 300 + PROMPT_TOKENS],
        W2: text[600 : 600 + PROMPT_TOKENS],
    }
    filler = text[900 : 900 + FILLER_TOKENS]
    gates = {w: StepGate(tmp_path / f"{w}.gate") for w in WORKERS}
    processes = start_mesh(
        etcd,
        tmp_path,
        {w: (POOL_MIB, LEND_CAPS[w]) for w in WORKERS},
        kv_manager_flags=KV_MANAGER_FLAGS,
        worker_flags=WORKER_FLAGS,
        worker_env={w: gates[w].env() for w in WORKERS},
    )
    kv_manager, workers = processes[0], dict(zip(WORKERS, processes[1:]))
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    streams: dict[str, asyncio.Task] = {}
    try:
        await mesh_ready(processes, config, WORKERS)
        assert all(gate.installed() for gate in gates.values()), "a worker started without its step gate"
        async with aio.insecure_channel(kv_manager.address) as channel:
            kv = kv_manager_pb2_grpc.KVManagerStub(channel)

            async def ledger() -> dict[str, kv_manager_pb2.LedgerEntry]:
                return {e.worker_id: e for e in (await kv.Ledger(kv_manager_pb2.LedgerRequest())).workers}

            async def ledger_shows(free: dict[str, int], lent: dict[str, dict[str, int]], what: str) -> None:
                """Until the kv_manager's ledger (what it suggests and plans from) says so."""
                await until(
                    ledger,
                    lambda rows: (
                        sorted(rows) == list(WORKERS)
                        and all(
                            rows[w].free_blocks == free[w] and dict(rows[w].lent_blocks) == lent[w]
                            for w in WORKERS
                        )
                    ),
                    what,
                )

            async def start(
                worker: str, stream: str, prompt: list[int], new_tokens: int, requests: int
            ) -> None:
                """Hand a request to ``worker`` (held) and let its engine take the one step that
                admits and prefills it."""
                streams[stream] = asyncio.create_task(generate(workers[worker], prompt, new_tokens))
                await listed(workers[worker], requests)
                await gates[worker].steps(1)

            rows = await ledger()
            assert {w: rows[w].total_blocks for w in WORKERS} == {w: POOL_BLOCKS for w in WORKERS}
            await ledger_shows({w: POOL_BLOCKS for w in WORKERS}, {w: {} for w in WORKERS}, "every pool free")

            # w1: the filler takes 2 blocks; w1's request then finds 6 free and borrows 2 from w2
            # (most lendable), and the filler's second token ends it: w1 has those 2 blocks free.
            await start(W1, "filler", filler, 2, requests=1)
            await start(W1, W1, prompts[W1], NEW_TOKENS, requests=2)
            await ledger_shows(
                {W0: 8, W1: 2, W2: 6}, {W0: {}, W1: {}, W2: {W1: 2}}, "w2 holds 2 blocks of w1's request"
            )
            # w2: 6 blocks free (2 lent to w1), borrows 2 from w0 (3 lendable, w1 only 2).
            await start(W2, W2, prompts[W2], NEW_TOKENS, requests=1)
            await ledger_shows(
                {W0: 6, W1: 2, W2: 0}, {W0: {W2: 2}, W1: {}, W2: {W1: 2}}, "w0 holds 2 blocks of w2's request"
            )
            # w0: 6 blocks free (2 lent to w2), borrows 2 from w1, the only one that can lend.
            await start(W0, W0, prompts[W0], NEW_TOKENS, requests=1)
            cycle = {W0: {W2: 2}, W1: {W0: 2}, W2: {W1: 2}}
            await ledger_shows({w: 0 for w in WORKERS}, cycle, "every pool full, the debts a cycle")

            reply = await kv.Defragment(kv_manager_pb2.DefragmentRequest(), timeout=COMMAND_TIMEOUT_S)
            assert not reply.failed_worker, f"{reply.failed_worker}: {reply.error_code} {reply.error}"
            assert [(list(s.cycle), s.blocks) for s in reply.plan.swaps] == [([W0, W1, W2], SWAP_BLOCKS)]
            assert (reply.swaps_done, reply.blocks_moved) == (1, 3 * SWAP_BLOCKS)
            assert (reply.plan.remote_blocks_before, reply.plan.remote_blocks_after) == (3 * SWAP_BLOCKS, 0)
            # The cycle is gone and occupancy unchanged: every pool still full, all with its own KV.
            await ledger_shows(
                {w: 0 for w in WORKERS}, {w: {} for w in WORKERS}, "no debt left in the ledger"
            )
            kv_ledger = await kv.Ledger(kv_manager_pb2.LedgerRequest())
            assert kv_ledger.dgfm_swaps_total == 1 and kv_ledger.leader_term > 0
            loads = await until(
                lambda: read_loads(config),
                lambda loads: all(
                    not loads[w]["borrowed_blocks"] and not loads[w]["lent_blocks"] for w in WORKERS
                ),
                "no worker reports a borrowed or lent block",
            )
            assert {w: loads[w]["free_blocks"] for w in WORKERS} == {w: 0 for w in WORKERS}
            for w in WORKERS:
                stats = await worker_stats(workers[w])
                assert (stats.dgfm_recalls, stats.dgfm_blocks_recalled) == (1, SWAP_BLOCKS), w
                # Every DGFM call carried the leader's term (issue 49): w0 staged out and in.
                taken = (stats.kv_manager_term, stats.leader_writes_accepted, stats.leader_writes_refused)
                assert taken == (kv_ledger.leader_term, 2 if w == W0 else 1, 0), w
                assert stats.kv_pages == stats.total_pages - stats.free_pages, w

        for gate in gates.values():
            gate.open()
        filler_tokens, _, filler_last, _ = await asyncio.wait_for(streams.pop("filler"), COMMAND_TIMEOUT_S)
        assert len(filler_tokens) == 2 and filler_last.finish_reason == types_pb2.FINISH_REASON_LENGTH
        for w in WORKERS:
            tokens, logprobs, last, stats = await asyncio.wait_for(streams.pop(w), COMMAND_TIMEOUT_S)
            assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH, w
            assert stats.preemptions == 0, f"{w}'s request was recomputed"
            assert_same_as_one_big_pool(loaded, prompts[w], tokens, logprobs, NEW_TOKENS)
        await until(
            lambda: read_loads(config), every_block_back(WORKERS), "every block is back with its worker"
        )
    finally:
        for task in streams.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for proc in processes:
            proc.kill()
