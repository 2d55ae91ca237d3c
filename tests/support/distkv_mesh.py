"""DistKV-LLM across real processes: a kv_manager and borrowing gpu_workers on a test's etcd, and
the checks the DistKV integration tests share (tests/integration/test_distkv.py,
test_distkv_dgfm.py): a greedy request streamed from a worker, its tokens and fp32
log-probabilities against one in-process engine whose pool holds it all, and every block back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch
from grpc import aio
from support.polling import HANG_GUARD_S
from support.polling import poll_until as until

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.etcd.membership import MembershipConfig, read_loads
from services.runtime.process.process import ServiceProcess

TOP_LOGPROBS = 5
"""Log-probabilities compared per step: the chosen token's and the 5 most likely (fp32)."""


def long_prompt(loaded, tokens: int = 1000) -> list[int]:
    """The first ``tokens`` token ids of a long, repetitive English text."""
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


def one_big_pool(loaded, prompt: list[int], new_tokens: int) -> tuple[list[int], list]:
    """Greedy tokens and per-step log-probabilities of one in-process engine whose pool holds it all."""
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=256))
    events = []
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, top_logprobs=TOP_LOGPROBS)
    engine.submit(GenerationRequest("ref", tuple(prompt), params), events.append)
    while engine.has_work():
        engine.step()
    steps = [e for e in events if e.token_id is not None]
    return [e.token_id for e in steps], [e.logprobs for e in steps]


def assert_same_as_one_big_pool(loaded, prompt, tokens, logprobs, new_tokens: int) -> None:
    """Greedy tokens identical; at every step the chosen token's fp32 log-probability and the top
    five's within 1e-3 (log-softmax of the logits: equal logits up to a shift)."""
    want_tokens, want_logprobs = one_big_pool(loaded, prompt, new_tokens)
    assert tokens == want_tokens
    assert len(logprobs) == len(want_logprobs)
    for got, want in zip(logprobs, want_logprobs):
        assert abs(got.logprob - want.logprob) <= 1e-3
        assert max(abs(a - b) for a, (_, b) in zip(got.top_logprobs, want.top, strict=True)) <= 1e-3


def start_mesh(
    etcd,
    tmp_path,
    workers: Mapping[str, tuple[int, int]],
    kv_manager_flags: Sequence[str] = (),
    worker_flags: Sequence[str] = (),
    worker_env: Mapping[str, Mapping[str, str]] | None = None,
) -> list[ServiceProcess]:
    """A kv_manager, then one borrowing worker per ``{instance id: (pool MiB, lend cap)}``, in
    float32; ``worker_env``: extra environment per instance id."""
    adapters = tmp_path / "adapters"
    adapters.mkdir(exist_ok=True)
    processes = [
        ServiceProcess(
            "kv_manager",
            ["--etcd-endpoints", etcd.endpoint, *kv_manager_flags],
            log_path=tmp_path / "kv_manager.log",
        ).start()
    ]
    for worker_id, (pool_mib, cap) in workers.items():
        flags = [
            "--dtype", "float32", "--pool-mib", str(pool_mib), "--kv-overflow", "borrow",
            "--lend-cap-blocks", str(cap), "--adapter-dir", str(adapters),
            "--etcd-endpoints", etcd.endpoint, "--instance-id", worker_id, "--grace-s", "5",
            "--lease-ttl-s", "15",  # outlives a SIGSTOP of the debtor under a loaded machine
            # "Every block back" means every pool whole again: no prompt block may stay cached.
            "--prefix-cache", "off",
            *worker_flags,
        ]  # fmt: skip
        env = dict((worker_env or {}).get(worker_id, {}))
        processes.append(
            ServiceProcess("gpu_worker", flags, log_path=tmp_path / f"{worker_id}.log", env=env).start()
        )
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


async def no_op(_: int) -> None:
    return None


async def generate(
    worker: ServiceProcess,
    prompt: list[int],
    new_tokens: int,
    after_token: Callable[[int], Awaitable[None]] = no_op,
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
