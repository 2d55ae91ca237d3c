"""An ``Engine`` over a 3-rank ``TensorParallelExecutor`` (this process is rank 0, the followers
are real ``python -m services.gpu_worker.executor.follower`` processes) equals an ``Engine`` over the
single-device ``LocalExecutor`` on the same SmolLM2-135M weights, in fp32.

A batch mixes 5 adapters (ranks 8/16/32/64, one rsLoRA, MLP targets, a rank pattern) and the base
model, greedy, 10 tokens each, with requests arriving while others decode: tokens are identical
and every step's logits within 1e-4. The executor cannot merge nor lend: dlora runs as fcfs and
borrowing as preemption, and the engine says so (``EngineStats.fallbacks``). A follower killed
with SIGKILL is reported by the group's monitor (an injected death handler instead of the
default, which exits the worker).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.executor.tp_group import FollowerMonitor, rank_threads, start_group
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from tests.gpu_worker.tp.test_tp_exactness import load_adapters

pytestmark = pytest.mark.model

N = 3
ATOL = 1e-4
NEW_TOKENS = 10
PROMPT_LENGTHS = [7, 19, 3, 12, 5, 9, 14]
REQUEST_ADAPTERS = ["r8-attn", "r16-all", "r32-rslora", "r64-mlp", None, "r8-pattern", "r16-all"]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapters(loaded, base_spec, tmp_path_factory):
    return load_adapters(base_spec, tmp_path_factory.mktemp("adapters"), pattern_layer=2)


def prompts(loaded) -> list[list[int]]:
    text = "In the beginning the universe was created. This has made a lot of people very angry and been "
    ids = loaded.tokenizer.encode(text * 3)
    return [ids[i : i + n] for i, n in enumerate(PROMPT_LENGTHS)]


def run(engine: Engine, adapters, all_prompts) -> tuple[dict, dict]:
    for adapter in adapters.values():
        engine.add_adapter(adapter)
    tokens: dict[str, list[int]] = {}
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    def submit(i: int) -> None:
        engine.submit(
            GenerationRequest(f"r{i}", tuple(all_prompts[i]), sampling, REQUEST_ADAPTERS[i]),
            lambda event: tokens.setdefault(event.request_id, []).append(event.token_id),
        )

    for i in range(4):
        submit(i)
    steps = 0
    while engine.has_work() or steps == 0:
        engine.step()
        steps += 1
        if steps == 3:  # decodes and new prefills in one batch
            for i in range(4, len(PROMPT_LENGTHS)):
                submit(i)
    assert engine.stats().kv_pages == 0  # unused cached prefix blocks count as free
    return tokens


def test_engine_over_tp3_equals_local_executor(loaded, adapters):
    all_prompts = prompts(loaded)
    local_logits: dict[str, list[torch.Tensor]] = {}
    local = local_engine(
        LlamaModel(loaded.config, loaded.weights, torch.float32),
        EngineConfig(pool_mib=64),
        on_logits=lambda rid, row: local_logits.setdefault(rid, []).append(row.clone()),
    )
    expected = run(local, adapters, all_prompts)
    local.executor.close()

    deaths: list[tuple[int, int]] = []
    config = EngineConfig(pool_mib=64, batch_policy="dlora", kv_overflow="borrow")
    executor = start_group(
        loaded.config, loaded.weights, config, N, model_path="", dtype=torch.float32, threads=N,
        on_death=lambda rank, code: deaths.append((rank, code)),
    )  # fmt: skip
    try:
        assert executor.layout.size == N and len(executor.group.pids) == N - 1
        tp_logits: dict[str, list[torch.Tensor]] = {}
        engine = Engine(
            executor,
            config,
            on_logits=lambda rid, row: tp_logits.setdefault(rid, []).append(row.clone()),
        )
        assert engine.stats().fallbacks == ("dlora->fcfs", "borrow->preempt")
        assert engine.policy.name == "fcfs" and engine.borrower is None
        got = run(engine, adapters, all_prompts)
    finally:
        executor.close()
    assert not deaths, f"a follower died: {deaths}"
    assert all(p.returncode == 0 for p in executor.group.procs.values())
    worst = 0.0
    for i, adapter in enumerate(REQUEST_ADAPTERS):
        rid = f"r{i}"
        assert got[rid] == expected[rid], f"{rid} ({adapter}): tokens differ"
        assert len(tp_logits[rid]) == len(local_logits[rid]) == NEW_TOKENS
        for step, (ours, theirs) in enumerate(zip(tp_logits[rid], local_logits[rid])):
            diff = (ours - theirs).abs().max().item()
            worst = max(worst, diff)
            assert diff <= ATOL, f"{rid} ({adapter}) step {step}: logits differ by {diff:.2e}"
    print(f"engine tp3 vs local: max |logit diff| {worst:.3e}")


def test_group_refuses_a_degree_that_does_not_divide_the_model(loaded):
    with pytest.raises(ValueError, match="--tp 2 does not divide"):
        start_group(loaded.config, loaded.weights, EngineConfig(), 2, model_path="", dtype=torch.float32)


def test_a_killed_follower_is_reported_by_the_monitor():
    """The monitor reports a SIGKILLed follower once (the default handler exits the worker)."""
    import subprocess
    import sys
    import threading

    procs = {
        rank: subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        for rank in (1, 2)
    }
    reported = threading.Event()
    deaths: list[tuple[int, int]] = []

    def on_death(rank: int, code: int) -> None:
        deaths.append((rank, code))
        reported.set()

    monitor = FollowerMonitor(procs, on_death, poll_s=0.01)
    try:
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        assert reported.wait(60), "the monitor did not report the dead follower"  # hang guard
        monitor.join(60)
        assert deaths == [(2, -signal.SIGKILL)]
    finally:
        monitor.stopping()
        for proc in procs.values():
            proc.kill()
            proc.wait()
    # once stopping, an exit is not a death
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    quiet = FollowerMonitor({1: proc}, on_death, poll_s=0.01)
    quiet.stopping()
    proc.wait()
    quiet.join(60)
    assert deaths == [(2, -signal.SIGKILL)]


def test_rank_threads_split_the_group_threads():
    assert rank_threads(8, 3) == 2
    assert rank_threads(2, 3) == 1


def test_a_real_follower_killed_is_reported(loaded):
    """SIGKILL one follower of a live group: the driver's monitor reports it (the default handler
    would exit the worker, so that the supervisor restarts the whole group)."""
    import threading

    import torch.distributed as dist

    reported = threading.Event()
    deaths: list[tuple[int, int]] = []

    def on_death(rank: int, code: int) -> None:
        deaths.append((rank, code))
        reported.set()

    executor = start_group(
        loaded.config, loaded.weights, EngineConfig(pool_mib=16), N, model_path="", dtype=torch.float32,
        threads=N, on_death=on_death,
    )  # fmt: skip
    group = executor.group
    try:
        os.kill(group.pids[1], signal.SIGKILL)
        assert reported.wait(120), "the monitor did not report the killed follower"  # hang guard
        assert deaths == [(1, -signal.SIGKILL)]
    finally:
        group.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
