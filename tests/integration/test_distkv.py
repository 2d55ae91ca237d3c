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
from collections.abc import Awaitable, Callable

import pytest
import torch
from grpc import aio
from support.polling import HANG_GUARD_S
from support.polling import poll_until as until

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.runtime.membership import MembershipConfig, read_loads
from services.runtime.process import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPT_TOKENS, NEW_TOKENS = 1000, 32
POOL_MIB = 18
"""SmolLM2-135M in fp32: a 16-token block is 30 layers × 24 KiB pages = 720 KiB, so 25 blocks =
400 tokens; the prompt needs 65 blocks, 40 of them borrowed."""
LEND_CAP_BLOCKS = 24
"""Each creditor lends at most 24 blocks, so the 40 borrowed blocks need both other workers."""


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def long_prompt(loaded) -> list[int]:
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


TOP_LOGPROBS = 5
"""Log-probabilities compared per step: the chosen token's and the 5 most likely (fp32)."""


def one_big_pool(loaded, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], list]:
    """Greedy tokens and per-step log-probabilities of one in-process engine whose pool holds it all."""
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = Engine(model, EngineConfig(pool_mib=256))
    events = []
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, top_logprobs=TOP_LOGPROBS)
    engine.submit(GenerationRequest("ref", tuple(prompt), params), events.append)
    while engine.has_work():
        engine.step()
    steps = [e for e in events if e.token_id is not None]
    return [e.token_id for e in steps], [e.logprobs for e in steps]


def assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs, new_tokens: int = NEW_TOKENS) -> None:
    """Greedy tokens identical; at every step the chosen token's fp32 log-probability and the top
    five's within 1e-3 (log-softmax of the logits: equal logits up to a shift)."""
    want_tokens, want_logprobs = one_big_pool(loaded, prompt, new_tokens)
    assert tokens == want_tokens
    assert len(logprobs) == len(want_logprobs)
    for got, want in zip(logprobs, want_logprobs):
        assert abs(got.logprob - want.logprob) <= 1e-3
        assert max(abs(a - b) for a, (_, b) in zip(got.top_logprobs, want.top, strict=True)) <= 1e-3


def start_mesh(etcd, tmp_path, workers: dict[str, tuple[int, int]]) -> list[ServiceProcess]:
    """A kv_manager, then one borrowing worker per ``{instance id: (pool MiB, lend cap)}``."""
    adapters = tmp_path / "adapters"
    adapters.mkdir(exist_ok=True)
    processes = [
        ServiceProcess(
            "kv_manager", ["--etcd-endpoints", etcd.endpoint], log_path=tmp_path / "kv_manager.log"
        ).start()
    ]
    for worker_id, (pool_mib, cap) in workers.items():
        flags = [
            "--dtype", "float32", "--pool-mib", str(pool_mib), "--kv-overflow", "borrow",
            "--lend-cap-blocks", str(cap), "--adapter-dir", str(adapters),
            "--etcd-endpoints", etcd.endpoint, "--instance-id", worker_id, "--grace-s", "5",
            "--lease-ttl-s", "15",  # outlives a SIGSTOP of the debtor under a loaded machine
        ]  # fmt: skip
        processes.append(ServiceProcess("gpu_worker", flags, log_path=tmp_path / f"{worker_id}.log").start())
    return processes


async def mesh_ready(processes: list[ServiceProcess], config: MembershipConfig, worker_ids) -> None:
    """Every process ready, and every worker's heartbeat carries its KV blocks."""
    for proc in processes:
        await proc.wait_ready(HANG_GUARD_S)
    await until(
        lambda: read_loads(config),
        lambda loads: all(loads.get(w, {}).get("total_blocks") for w in worker_ids),
        "every worker's heartbeat carries its KV blocks",
    )


async def generate(
    worker: ServiceProcess, prompt: list[int], new_tokens: int, after_token: Callable[[int], Awaitable[None]]
) -> tuple[list[int], list, worker_pb2.GenerateResponse, worker_pb2.WorkerStatsResponse]:
    """A greedy request on ``worker``, ``after_token(n)`` awaited once its n-th token is out;
    its tokens, their log-probabilities, its last reply and the worker's stats afterwards."""
    async with aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=types_pb2.SamplingParams(
                max_tokens=new_tokens, ignore_eos=True, top_logprobs=TOP_LOGPROBS
            ),
        )
        tokens, logprobs, last = [], [], None
        async for reply in stub.Generate(request):  # pytest-timeout guards a hang
            logprobs += reply.logprobs
            for token in reply.token_ids:
                tokens.append(token)
                await after_token(len(tokens))
            last = reply
        return tokens, logprobs, last, await stub.Stats(worker_pb2.WorkerStatsRequest())


async def held_until(worker: ServiceProcess, config: MembershipConfig, loads_show, what: str) -> None:
    """Hold ``worker`` still (SIGSTOP: its KV stays where it is) until the heartbeats in etcd
    satisfy ``loads_show``."""
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        await until(lambda: read_loads(config), loads_show, what)
    finally:
        os.kill(worker.pid, signal.SIGCONT)


def every_block_back(worker_ids):
    """Nothing lent, nothing borrowed, every pool whole again."""
    return lambda loads: all(
        not loads[w]["lent_blocks"]
        and not loads[w]["borrowed_blocks"]
        and loads[w]["free_blocks"] == loads[w]["total_blocks"]
        for w in worker_ids
    )


async def test_a_prompt_longer_than_any_pool_spreads_over_three_workers_and_matches_one_big_pool(
    etcd, tmp_path, loaded
):
    prompt = long_prompt(loaded)
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
        assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs)
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
    prompt = long_prompt(loaded)[:prompt_tokens]
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
    prompt = long_prompt(loaded)
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
        assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs)
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
