"""The gpu_worker as an operator runs it: a real process serving the real model (fp32 on CPU)."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
import torch
from grpc import aio
from support.polling import HANG_GUARD_S
from support.polling import poll_until as until

from bench.sample_adapters import SampleAdapterSpec, adapter_files, read_peft_directory, write_peft_adapter
from mesh_api.adapter_transfer import upload_adapter
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.etcd.membership import MembershipConfig, list_members, read_loads
from services.runtime.process.process import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.model]

WORKER_FLAGS = ["--dtype", "float32", "--pool-mib", "128", "--grace-s", "30"]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_root(base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("worker-adapters")
    write_peft_adapter(root / "sql", base_spec, SampleAdapterSpec(rank=8, scale=0.05, seed=3))
    write_peft_adapter(
        root / "chat", base_spec, SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.05)
    )
    return root


@pytest.fixture
def worker(tmp_path, adapter_root):
    processes = []

    def start(*extra: str) -> ServiceProcess:
        proc = ServiceProcess(
            "gpu_worker", [*WORKER_FLAGS, *extra], log_path=tmp_path / f"worker{len(processes)}.log"
        ).start()
        processes.append(proc)
        return proc

    yield start
    for proc in processes:
        proc.kill()


def in_process_tokens(loaded, adapter_root, prompt, adapter, max_tokens) -> list[int]:
    engine = local_engine(
        LlamaModel(loaded.config, loaded.weights, torch.float32), EngineConfig(pool_mib=128)
    )
    if adapter:
        engine.add_adapter(read_peft_directory(adapter, adapter_root / adapter, torch.float32))
    tokens: list[int] = []
    engine.submit(
        GenerationRequest(
            "x", tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter
        ),
        lambda e: tokens.append(e.token_id),
    )
    while engine.has_work():
        engine.step()
    return tokens


async def generate(
    stub, prompt, adapter="", max_tokens=8, first_token: asyncio.Event | None = None, **sampling
) -> tuple[list[int], worker_pb2.GenerateResponse]:
    """Stream one request to the end; ``first_token`` is set once its first token arrived."""
    tokens, last = [], None
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        adapter_id=adapter,
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )
    async for reply in stub.Generate(request, timeout=120):
        tokens += reply.token_ids
        last = reply
        if first_token is not None and tokens:
            first_token.set()
    return tokens, last


async def test_standalone_worker_serves_base_and_adapters_like_the_engine(worker, adapter_root, loaded):
    proc = worker("--adapter-dir", str(adapter_root))
    await proc.wait_ready(120)
    prompt = loaded.tokenizer.encode("The capital of France is")
    async with aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        results = await asyncio.gather(*(generate(stub, prompt, a, 8) for a in ["", "sql", "chat"]))
        for adapter, (tokens, last) in zip(["", "sql", "chat"], results):
            assert tokens == in_process_tokens(loaded, adapter_root, prompt, adapter or None, 8), adapter
            assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH
            assert last.timings.output_tokens == 8 and last.timings.prompt_tokens == len(prompt)
            assert 0 < last.timings.first_token_ms <= last.timings.total_ms

        first = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id="sql"))
        again = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id="sql"))
        assert first.rank == 8 and again.was_resident
        assert list((await stub.Prefetch(worker_pb2.PrefetchRequest(adapter_ids=["sql"]))).started) == []
        stats = await stub.Stats(worker_pb2.WorkerStatsRequest())
        assert set(stats.resident_adapters) == {"sql", "chat"} and stats.kv_pages == 0
        assert stats.model == "SmolLM2-135M-Instruct" and stats.dtype == "float32"


@pytest.mark.parametrize(
    "request_kwargs, code, needle",
    [
        ({"adapter_id": "nope"}, grpc.StatusCode.NOT_FOUND, "nope"),
        (
            {"sampling": types_pb2.SamplingParams(temperature=-1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        ({"sampling": types_pb2.SamplingParams(top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"prompt_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ({"prompt_token_ids": [10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
    ],
)
async def test_bad_requests_get_clear_statuses_and_the_worker_keeps_serving(
    worker, adapter_root, request_kwargs, code, needle
):
    proc = worker("--adapter-dir", str(adapter_root))
    await proc.wait_ready(120)
    async with aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
        for key, value in request_kwargs.items():
            if key == "sampling":
                request.sampling.CopyFrom(value)
            elif key == "prompt_token_ids":
                del request.prompt_token_ids[:]
                request.prompt_token_ids.extend(value)
            else:
                setattr(request, key, value)
        with pytest.raises(grpc.RpcError) as err:
            async for _ in stub.Generate(request, timeout=60):
                pass
        assert err.value.code() == code and needle in err.value.details()
        tokens, _ = await generate(stub, [1, 2, 3], max_tokens=2)
        assert len(tokens) == 2


async def test_cancelled_stream_frees_its_pages(worker, adapter_root):
    proc = worker("--adapter-dir", str(adapter_root))
    await proc.wait_ready(120)
    async with aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(
            worker_pb2.GenerateRequest(
                prompt_token_ids=list(range(1, 60)), sampling=types_pb2.SamplingParams(max_tokens=500)
            )
        )
        await call.read()

        def stats():
            return stub.Stats(worker_pb2.WorkerStatsRequest())

        # Stats are a snapshot taken after each step: wait for one that shows the request.
        await until(stats, lambda s: s.kv_pages > 0, "the request holds pages")
        call.cancel()
        await until(
            stats, lambda s: s.kv_pages == 0 and s.running == 0, "the cancelled request freed its pages"
        )


async def test_sigterm_finishes_in_flight_requests_then_exits_0(worker, adapter_root):
    proc = worker("--adapter-dir", str(adapter_root))
    await proc.wait_ready(120)
    async with aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        started = [asyncio.Event() for _ in range(4)]
        streams = [
            asyncio.create_task(generate(stub, [1 + i, 2, 3], "sql" if i % 2 else "", 16, started[i]))
            for i in range(4)
        ]
        # Every stream is in flight (it has its first token and 15 to go) when the signal lands.
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), HANG_GUARD_S)
        proc.signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
    assert all(
        len(tokens) == 16 and last.finish_reason == types_pb2.FINISH_REASON_LENGTH for tokens, last in results
    )
    assert await asyncio.to_thread(proc.proc.wait, 60) == 0


async def test_worker_in_the_mesh_pulls_adapters_from_the_store_and_reports_load(
    worker, etcd, tmp_path, adapter_root, loaded
):
    store = ServiceProcess(
        "adapter_store", ["--etcd-endpoints", etcd.endpoint, "--data-dir", str(tmp_path / "store")],
        log_path=tmp_path / "store.log",
    ).start()  # fmt: skip
    try:
        await store.wait_ready()
        async with aio.insecure_channel(store.address) as channel:
            info = await upload_adapter(
                adapter_store_pb2_grpc.AdapterStoreStub(channel),
                adapter_files(adapter_root / "sql"),
                "sql",
                "alice",
            )
        proc = worker("--etcd-endpoints", etcd.endpoint)
        await proc.wait_ready(120)
        prompt = loaded.tokenizer.encode("The capital of France is")
        async with aio.insecure_channel(proc.address) as channel:
            tokens, _ = await generate(worker_pb2_grpc.WorkerStub(channel), prompt, info.id, 6)
        assert tokens == in_process_tokens(loaded, adapter_root, prompt, "sql", 6)
        config = MembershipConfig(etcd_endpoints=etcd.endpoint)
        members = await list_members(config, "gpu_worker")
        assert [m.address for m in members] == [proc.address]
        loads = await until(
            lambda: read_loads(config),
            lambda ls: info.id in ls.get(members[0].instance_id, {}).get("resident_adapters", []),
            "the load report lists the adapter as resident",
        )
        load = loads[members[0].instance_id]
        assert load["total_pages"] > 0 and "free_pages" in load and "queue" in load and "tokens_per_s" in load
        assert info.id in load["resident_adapters"]
    finally:
        store.kill()
