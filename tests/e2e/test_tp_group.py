"""A tensor-parallel group is one worker of the mesh, and a rank that dies takes its group down
without losing a request.

One ``loramesh up --detach --workers 2 --tp 3`` mesh in float32 (two groups of three rank
processes each). 16 greedy streams over 4 uploaded adapters (ranks 8, 16, 32, 64; one rsLoRA; MLP
targets) and the base model run undisturbed; then 16 more get their first token, the workers are
held (SIGSTOP), one *follower* rank of gpu_worker-0 is killed with SIGKILL, and the workers go on:
the group's driver exits (its monitor), its other follower dies with it (no orphan rank), the
supervisor restarts the group, and every stream ends with exactly the undisturbed output (the
gateway resumes gpu_worker-0's streams on gpu_worker-1).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.cli import loramesh
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from loramesh_cli.mesh_file import MeshFile, pid_alive
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from tests.e2e.test_failover import (
    Stream,
    client,
    finish_wave,
    outputs,
    registered_members,
    signal_workers,
)

pytestmark = [pytest.mark.integration, pytest.mark.model]

STREAMS = 16
MAX_TOKENS = 10
ADAPTERS = {
    "tp-r8": SampleAdapterSpec(rank=8, seed=51),
    "tp-r16-all": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=52),
    "tp-r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, lora_alpha=8.0, seed=53),
    "tp-r64-mlp": SampleAdapterSpec(rank=64, target_modules=("q_proj", "v_proj", "gate_proj", "up_proj",
                                                             "down_proj"), lora_alpha=32.0, seed=54),
}  # fmt: skip
NAMES = [*ADAPTERS, None]
JOBS = [
    (f"Write one sentence about {topic}.", NAMES[i % len(NAMES)])
    for i, topic in enumerate(
        ["rivers", "owls", "bread", "trains", "snow", "maps", "bees", "glass",
         "clocks", "salt", "kites", "moss", "ink", "wool", "caves", "lamps"]
    )
]  # fmt: skip


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, base_spec) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-adapters")
    return {name: write_peft_adapter(root / name, base_spec, spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def tp_mesh(tmp_path_factory, adapter_dirs):
    state = tmp_path_factory.mktemp("tp") / "state"
    loramesh(
        state, "up", "--detach", "--workers", "2", "--tp", "3", "--dtype", "float32", "--pool-mib", "64",
        "--gateways", "1", "--schedulers", "1", "--kv-managers", "1", "--restart-backoff-s", "0.2",
    )  # fmt: skip
    try:
        for name, directory in adapter_dirs.items():
            loramesh(state, "adapters", "upload", str(directory), "--name", name)
        yield state
    finally:
        loramesh(state, "down", check=False)


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc/*/stat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def start_wave(sdk) -> list[tuple[Stream, asyncio.Task]]:
    async def consume(prompt: str, adapter: str | None, into: Stream) -> None:
        from loramesh import LoraMeshError

        try:
            async for delta in sdk.stream(prompt, adapter=adapter, max_tokens=MAX_TOKENS, ignore_eos=True):
                into.tokens += delta.token_ids
                into.text += delta.text
                into.finish = delta.finish_reason or into.finish
        except LoraMeshError as error:
            into.error = error

    wave = []
    for prompt, adapter in JOBS:
        stream = Stream()
        wave.append((stream, asyncio.create_task(consume(prompt, adapter, stream))))
    return wave


def one_process(
    adapter_dirs, jobs: list[tuple[str, str | None]], ignore_eos: bool
) -> tuple[list[list[int]], object]:
    """What ``--tp 1`` computes: the engine over one process's model (LocalExecutor), every job
    batched together, greedy, in float32; and the tokenizer."""
    loaded = load_model()
    engine = local_engine(LlamaModel(loaded.config, loaded.weights, torch.float32), EngineConfig(pool_mib=256),
                    eos_token_ids=loaded.config.eos_token_ids)  # fmt: skip
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    tokens: dict[str, list[int]] = {}
    for i, (prompt, adapter) in enumerate(jobs):
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
        engine.submit(
            GenerationRequest(str(i), tuple(loaded.tokenizer.encode(prompt)), sampling, adapter),
            lambda e: tokens.setdefault(e.request_id, []).append(e.token_id),
        )
    while engine.has_work():
        engine.step()
    return [[t for t in tokens[str(i)] if t is not None] for i in range(len(jobs))], loaded.tokenizer


def test_a_tp_3_mesh_generates_what_tp_1_does(tp_mesh, adapter_dirs):
    """16 greedy streams batched over 4 adapters and the base (ranks 8-64, rsLoRA, MLP targets) on
    the --tp 3 mesh, and `loramesh generate` with an adapter: the same tokens as one process."""

    async def stream_all():
        async with client(tp_mesh) as sdk:
            return outputs(await finish_wave(start_wave(sdk)))

    streamed = asyncio.run(stream_all())
    expected, tokenizer = one_process(adapter_dirs, JOBS, ignore_eos=True)
    assert [list(tokens) for tokens, _, _ in streamed] == expected
    prompt, adapter = JOBS[3]
    printed = loramesh(
        tp_mesh, "generate", prompt, "--adapter", adapter, "--max-tokens", str(MAX_TOKENS)
    ).stdout
    [tokens], _ = one_process(adapter_dirs, [(prompt, adapter)], ignore_eos=False)
    assert printed.strip() == tokenizer.decode(tokens).strip()


def test_status_says_each_worker_is_a_group_of_3(tp_mesh):
    rows = json.loads(loramesh(tp_mesh, "status", "--json").stdout)
    workers = [r for r in rows if r["service"] == "gpu_worker"]
    assert len(workers) == 2 and {r["health"] for r in rows} == {"SERVING"}
    for row in workers:
        assert row["load"]["tp"] == 3


def test_kill_9_of_a_follower_rank_loses_nothing_and_the_group_comes_back(tp_mesh):
    asyncio.run(kill_a_follower(tp_mesh))


async def kill_a_follower(state: Path) -> None:
    mesh_file = MeshFile.read(state)
    entry = mesh_file.services["gpu_worker-0"]
    followers = children(entry.pid)
    assert len(followers) == 2, f"gpu_worker-0 ({entry.pid}) has follower ranks {followers}"
    async with client(state) as sdk:
        undisturbed = outputs(await finish_wave(start_wave(sdk)))
        assert all(len(t) == MAX_TOKENS and f == "length" for t, _, f in undisturbed)
        wave = start_wave(sdk)
        await poll_until(
            lambda: asyncio.sleep(0, [s for s, _ in wave]),
            lambda streams: all(s.tokens or s.error for s in streams),
            "every stream has its first token",
        )
        signal_workers(mesh_file, signal.SIGSTOP)
        try:
            in_flight = sum(1 for s, _ in wave if s.finish is None and s.error is None)
            killed_unix = time.time()
            os.kill(followers[0], signal.SIGKILL)
        finally:
            signal_workers(mesh_file, signal.SIGCONT)
        results = outputs(await finish_wave(wave))
    errors = [str(s.error) for s, _ in wave if s.error is not None]
    assert not errors, f"lost {len(errors)} of {STREAMS} requests: {errors[:3]}"
    assert results == undisturbed
    # The group went down together (no orphan rank) and the supervisor brought it back.
    await poll_until(
        lambda: asyncio.sleep(0, [entry.pid, *followers]),
        lambda pids: not any(pid_alive(p) for p in pids),
        "the driver and both followers of the old group gone",
    )
    restarted = await poll_until(
        lambda: asyncio.sleep(0, MeshFile.read(state).services["gpu_worker-0"]),
        lambda e: e.restarts == entry.restarts + 1 and pid_alive(e.pid) and e.pid != entry.pid,
        "gpu_worker-0 restarted",
        guard_s=180,
    )
    await poll_until(
        lambda: registered_members(mesh_file),
        lambda members: members.get("gpu_worker-0", 0.0) > killed_unix,
        "gpu_worker-0 registered again",
        guard_s=300,
        interval_s=0.5,
    )
    assert len(children(restarted.pid)) == 2, "the restarted group has two follower ranks"
    print(
        f"\nkill -9 a follower of gpu_worker-0: {in_flight} of {STREAMS} in flight, 0 lost, group restarted"
    )
