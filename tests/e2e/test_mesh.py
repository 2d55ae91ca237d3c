"""One request through the whole mesh, as a user sees it through the SDK: many adapters at once,
resume across a killed worker, tenants and bad input."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch
from support.mesh import start_mesh, wait_for_workers

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from loramesh import AsyncClient
from loramesh import errors as sdk_errors
from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.security.tls import aio_channel

pytestmark = [pytest.mark.integration, pytest.mark.model]

ADAPTER_NAMES = [f"ad{i}" for i in range(8)]
TOPICS = ["the sea", "a robot", "tea", "mountains", "a library", "winter", "a city", "music"]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_dirs(base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-adapters")
    return {
        name: write_peft_adapter(
            root / name,
            base_spec,
            SampleAdapterSpec(
                rank=[8, 16, 32, 64][i % 4],
                target_modules=LORA_TARGETS if i % 2 else ("q_proj", "k_proj", "v_proj", "o_proj"),
                scale=0.04,
                seed=100 + i,
            ),
        )
        for i, name in enumerate(ADAPTER_NAMES)
    }


def in_process(loaded, adapter_dirs, jobs: list[tuple[str, str | None]], max_tokens: int) -> list[list[int]]:
    """The engine's own greedy output for (prompt, adapter) jobs, all batched in one engine."""
    engine = local_engine(
        LlamaModel(loaded.config, loaded.weights, torch.float32),
        EngineConfig(pool_mib=256),
        eos_token_ids=loaded.config.eos_token_ids,
    )
    for name, directory in adapter_dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    outputs: dict[str, list[int]] = {}
    for i, (prompt, adapter) in enumerate(jobs):
        engine.submit(
            GenerationRequest(
                str(i), tuple(loaded.tokenizer.encode(prompt)), SamplingParams(max_tokens=max_tokens), adapter
            ),
            lambda e: outputs.setdefault(e.request_id, []).append(e.token_id),
        )
    while engine.has_work():
        engine.step()
    return [[t for t in outputs[str(i)] if t is not None] for i in range(len(jobs))]


async def upload_all(client: AsyncClient, adapter_dirs) -> None:
    for name, directory in adapter_dirs.items():
        await client.adapters.upload(directory, name)


async def test_32_concurrent_streams_over_8_adapters_match_the_engine(mesh, loaded, adapter_dirs):
    jobs = [
        (f"Write one sentence about {TOPICS[i % 8]}.", (ADAPTER_NAMES + [None])[i % 9]) for i in range(32)
    ]
    async with AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as client:
        await upload_all(client, adapter_dirs)
        results = await asyncio.gather(*(client.generate(p, adapter=a, max_tokens=10) for p, a in jobs))
    expected = in_process(loaded, adapter_dirs, jobs, 10)
    for (prompt, adapter), result, tokens in zip(jobs, results, expected):
        assert list(result.token_ids) == tokens, (prompt, adapter)
        assert result.text == loaded.tokenizer.decode(tokens) or result.finish_reason == "stop"
    assert {r.finish_reason for r in results} <= {"stop", "length"}


async def test_kill_9_of_a_worker_mid_stream_loses_and_repeats_nothing(mesh, loaded, adapter_dirs):
    jobs = [
        (f"Tell me about {TOPICS[i % 8]} in detail.", (ADAPTER_NAMES[:3] + [None])[i % 4]) for i in range(16)
    ]
    first_tokens = asyncio.Event()

    async def run(client, prompt, adapter):
        tokens, resumes = [], 0
        async for delta in client.stream(prompt, adapter=adapter, max_tokens=24):
            tokens += delta.token_ids
            if len(tokens) >= 3:
                first_tokens.set()
            if delta.usage is not None:
                resumes = delta.usage.resumes
        return tokens, resumes

    async with AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as client:
        await upload_all(client, {k: adapter_dirs[k] for k in ADAPTER_NAMES[:3]})
        streams = [asyncio.create_task(run(client, p, a)) for p, a in jobs]
        await first_tokens.wait()
        mesh.workers[0].signal(signal.SIGKILL)
        results = await asyncio.gather(*streams)
    expected = in_process(loaded, adapter_dirs, jobs, 24)
    assert [tokens for tokens, _ in results] == expected
    assert sum(resumes for _, resumes in results) > 0, "no stream was on the killed worker"


async def test_tenants_keys_and_bad_input(mesh, adapter_dirs, tmp_path):
    async with (
        AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as alice,
        AsyncClient(mesh.gateway.address, "key-bob", tls=mesh.client_tls) as bob,
    ):
        await alice.adapters.upload(adapter_dirs["ad0"], "secret")
        await alice.adapters.upload(adapter_dirs["ad1"], "shared", public=True)
        # Another tenant's private adapter answers exactly as a missing one does.
        with pytest.raises(sdk_errors.NotFound) as private:
            await bob.generate("hi", adapter="alice/secret", max_tokens=2)
        with pytest.raises(sdk_errors.NotFound) as missing:
            await bob.generate("hi", adapter="alice/nothing", max_tokens=2)
        assert str(private.value.details).replace("secret", "nothing") == str(missing.value.details)
        assert "alice/secret" not in {m.id for m in await bob.models()}
        assert [a.name for a in await bob.adapters.list()] == ["shared"]
        assert (await bob.generate("hi", adapter="alice/shared", max_tokens=2)).finish_reason in (
            "length",
            "stop",
        )
        with pytest.raises(sdk_errors.NotFound):
            await bob.generate("hi", adapter="nope", max_tokens=2)
        with pytest.raises(sdk_errors.InvalidArgument, match="max_tokens"):
            await alice.generate("hi", max_tokens=100_000)
        with pytest.raises(sdk_errors.InvalidArgument, match="temperature"):
            await alice.generate("hi", temperature=-1.0)
        with pytest.raises(sdk_errors.InvalidArgument, match="prompt"):
            await alice.generate("word " * 5000, max_tokens=2)
    async with AsyncClient(mesh.gateway.address, "wrong-key", tls=mesh.client_tls) as stranger:
        with pytest.raises(sdk_errors.Unauthenticated):
            await stranger.generate("hi", max_tokens=2)
    # A right key in plaintext: refused at the TLS handshake.
    no_mesh_file = tmp_path / "absent.json"
    async with AsyncClient(mesh.gateway.address, "key-alice", retries=0, mesh_file=no_mesh_file) as plain:
        with pytest.raises(sdk_errors.Unavailable):
            await plain.generate("hi", max_tokens=2)
    async with aio_channel(mesh.gateway.address, mesh.operator_tls) as channel:  # a mesh certificate, no key
        with pytest.raises(grpc.RpcError) as err:
            async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateTextRequest(prompt="hi")
            ):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()


async def test_overload_is_refused_quickly_while_admitted_requests_complete(tmp_path):
    # The one e2e mesh in plaintext (mutual TLS off, the default): that mode keeps working too.
    mesh = await start_mesh(
        tmp_path, scheduler_flags=("--max-queue-per-worker", "2"), worker_flags=("--max-running", "2")
    )
    try:
        await wait_for_workers(mesh, 2)
        async with AsyncClient(mesh.gateway.address, "key-alice", retries=0) as client:

            async def attempt(i: int):
                started = time.monotonic()
                try:
                    result = await client.generate(f"Count to {i}:", max_tokens=6)
                    return "done", result, time.monotonic() - started
                except sdk_errors.ResourceExhausted as error:
                    return "refused", error, time.monotonic() - started

            outcomes = await asyncio.gather(*(attempt(i) for i in range(40)))
        done = [o for o in outcomes if o[0] == "done"]
        refused = [o for o in outcomes if o[0] == "refused"]
        assert refused and done
        assert all(o[1].finish_reason in ("length", "stop") for o in done)
        assert all(o[1].retry_after_s is not None and o[1].retry_after_s > 0 for o in refused)
        latencies = sorted(o[2] for o in refused)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"refused {len(refused)}/40, rejection latency p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms; slowest admitted {max(o[2] for o in done):.2f} s")  # fmt: skip
    finally:
        mesh.stop()
