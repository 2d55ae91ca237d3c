"""DistKV-LLM across real processes (issue 13's acceptance tests): gpu_workers with small pools
and ``--kv-overflow borrow``, a kv_manager and a real etcd. A prompt longer than any one pool
completes with its KV on all three workers, and its greedy tokens are those of one engine with a
large pool; a prompt that fits the debtor's pool but whose decoding crosses its end borrows
then and matches too; kill -9 of the creditor mid-generation costs a recompute, not the output.

Scaled down from the issue's figures so the suite stays within a couple of minutes on 2 CPU
cores: pools of 400 tokens of KV (not ~1,000) and a 1,000-token prompt + 32 new tokens (not
2,500 + 64), the same proportions (prompt ≈ 2.5 pools). At full size (POOL_MIB 45 = 1,024
tokens, LEND_CAP_BLOCKS 56, 2,500 + 64 tokens) it passes too, in about 130 s on a quiet 2-core
machine, which is too long for the suite. Besides the greedy tokens, every step's fp32
log-probabilities (the chosen token's and the top five's, which the Worker API returns on
request) agree with the big pool's within 1e-3.
"""

from __future__ import annotations

import os
import signal

import pytest
from support.distkv_mesh import (
    assert_same_as_one_big_pool,
    every_block_back,
    generate,
    held_until,
    long_prompt,
    mesh_ready,
    start_mesh,
)
from support.polling import poll_until as until

from mesh_api.v1 import types_pb2
from services.runtime.etcd.membership import MembershipConfig, read_loads

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPT_TOKENS, NEW_TOKENS = 1000, 32
POOL_MIB = 18
"""SmolLM2-135M in fp32: a 16-token block is 30 layers × 24 KiB pages = 720 KiB, so 25 blocks =
400 tokens; the prompt needs 65 blocks, 40 of them borrowed."""
LEND_CAP_BLOCKS = 24
"""Each creditor lends at most 24 blocks, so the 40 borrowed blocks need both other workers."""


async def test_a_prompt_longer_than_any_pool_spreads_over_three_workers_and_matches_one_big_pool(
    etcd, tmp_path, loaded
):
    prompt = long_prompt(loaded, PROMPT_TOKENS)
    worker_ids = [f"gpu_worker-w{i}" for i in range(3)]
    processes = start_mesh(etcd, tmp_path, {w: (POOL_MIB, LEND_CAP_BLOCKS) for w in worker_ids})
    debtor = processes[1]
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    try:
        await mesh_ready(processes, config, worker_ids)

        async def after_token(n: int) -> None:
            if n == 1:  # the prompt's KV is placed: it must be on all three workers
                await held_until(
                    debtor,
                    config,
                    lambda loads: all(loads[w]["lent_blocks"].get(worker_ids[0]) for w in worker_ids[1:]),
                    "both creditors hold blocks of the debtor",
                )

        tokens, logprobs, last, stats = await generate(debtor, prompt, NEW_TOKENS, after_token)
        assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert stats.preemptions == 0
        assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs, NEW_TOKENS)
        await until(
            lambda: read_loads(config), every_block_back(worker_ids), "every block is back with its worker"
        )
    finally:
        for proc in processes:
            proc.kill()


async def test_a_request_that_starts_local_borrows_when_decoding_crosses_the_pool_end(etcd, tmp_path, loaded):
    """The debtor's pool holds 400 tokens (25 blocks); a 390-token prompt fits it. The step that
    holds token 401 borrows the 26th block from the other worker: the debtor is held still once
    that token is out until the creditor's heartbeat shows exactly that block. Two workers, not
    three: one creditor is enough for one block."""
    prompt_tokens, new_tokens = 390, 16
    # Token k comes out of the step that holds prompt + k - 1 tokens: token 12 of the one with 401.
    crossed_at = 400 - prompt_tokens + 2
    prompt = long_prompt(loaded, PROMPT_TOKENS)[:prompt_tokens]
    workers = {"gpu_worker-w0": (POOL_MIB, 0), "gpu_worker-w1": (POOL_MIB, LEND_CAP_BLOCKS)}
    processes = start_mesh(etcd, tmp_path, workers)
    debtor = processes[1]
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    try:
        await mesh_ready(processes, config, workers)
        loads = await read_loads(config)
        assert [loads[w]["total_blocks"] for w in workers] == [25, 25]  # 400 tokens each

        async def after_token(n: int) -> None:
            if n == crossed_at:
                await held_until(
                    debtor,
                    config,
                    lambda loads: loads["gpu_worker-w1"]["lent_blocks"] == {"gpu_worker-w0": 1},
                    "the creditor holds the one block the debtor crossed into",
                )

        tokens, logprobs, last, stats = await generate(debtor, prompt, new_tokens, after_token)
        assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert stats.preemptions == 0  # its local KV stayed where it was
        assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs, new_tokens)
        await until(
            lambda: read_loads(config), every_block_back(workers), "every block is back with its worker"
        )
    finally:
        for proc in processes:
            proc.kill()


async def test_kill_9_of_the_creditor_mid_generation_recomputes_and_loses_nothing(etcd, tmp_path, loaded):
    """The debtor's pool holds 25 blocks and the prompt needs 65: both creditors could lend the
    other 40, w1 (the larger cap) is suggested first. It is killed once the first token is out
    (its blocks hold the prompt's KV by then); the debtor is stopped (SIGSTOP) around the kill
    so that the kill lands before its next step, not racing the remaining decode steps."""
    prompt = long_prompt(loaded, PROMPT_TOKENS)
    workers = {"gpu_worker-w0": (POOL_MIB, 0), "gpu_worker-w1": (36, 45), "gpu_worker-w2": (36, 44)}
    processes = start_mesh(etcd, tmp_path, workers)
    debtor, creditor = processes[1:3]
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    try:
        await mesh_ready(processes, config, workers)

        async def after_token(n: int) -> None:
            if n == 1:
                os.kill(debtor.pid, signal.SIGSTOP)
                creditor.kill()
                os.kill(debtor.pid, signal.SIGCONT)

        tokens, logprobs, last, stats = await generate(debtor, prompt, NEW_TOKENS, after_token)
        assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert stats.preemptions == 1, "the request was not recomputed after the creditor died"
        assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs, NEW_TOKENS)
        # The dead creditor leaves the ledger with its lease; the others account for every block.
        survivors = every_block_back(["gpu_worker-w0", "gpu_worker-w2"])
        await until(
            lambda: read_loads(config),
            lambda loads: "gpu_worker-w1" not in loads and survivors(loads),
            "the dead creditor is gone and every other block is back with its worker",
        )
    finally:
        for proc in processes:
            proc.kill()
