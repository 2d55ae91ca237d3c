"""A real worker's ``/metrics`` scraped during a run: an in-process gpu_worker (the runtime's
ServiceHost, real gRPC and HTTP on loopback) over a tiny random Llama and three real PEFT
adapters, with requests for two adapters in flight at once.

The engine thread is held inside its first forward pass (its logits observer waits on an event),
so which request runs and which waits is fixed while the test scrapes, whatever the machine's
speed. Sizes make evictions exact: every adapter (rank 64 on all seven projections) is 128 pool
pages and 512 KiB of host RAM; the pool has 256 pages and the host budget is 1 MiB.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest
from grpc import aio
from support.polling import HANG_GUARD_S, poll_until
from support.prometheus_scrape import scrape
from support.tiny_hf_model import SPEC, write_tiny_hf_model

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.quota_metrics import QuotaMetrics
from services.gateway.request_metrics import RequestMetrics
from services.gateway.tenant_quota import TenantQuota
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.service import WorkerService
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.rpc.server import ServiceHost

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "loramesh-dashboard.json"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("a", "b", "c")):
        write_peft_adapter(
            root / name,
            SPEC,
            SampleAdapterSpec(rank=64, target_modules=LORA_TARGETS, dtype="float32", seed=seed),
        )
    return root


@pytest.fixture
async def worker(model_dir, adapter_dir):
    config = WorkerConfig(
        model=str(model_dir), adapter_dir=str(adapter_dir), dtype="float32", device="cpu",
        pool_mib=1, max_running=1, host_cache_mib=1, host="127.0.0.1", grace_s=1,
    )  # fmt: skip
    service = WorkerService(config)
    host = ServiceHost(service, config)
    await host.listen()
    await host.become_ready()
    try:
        yield service, host
    finally:
        await host.shutdown()


async def generate(stub, adapter: str, prompt: list[int]) -> list[int]:
    tokens = []
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        adapter_id=adapter,
        sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    async for reply in stub.Generate(request, timeout=HANG_GUARD_S):
        tokens += reply.token_ids
    return tokens


def loaded_levels(metrics) -> dict[str, str]:
    return {s.labels["adapter_name"]: s.labels["level"] for s in metrics.series("vllm:lora_adapter_loaded")}


def lora_info(metrics) -> dict[str, str]:
    (series,) = metrics.series("vllm:lora_requests_info")
    return series.labels


async def test_scrape_during_a_run_shows_per_adapter_router_and_residency_series(worker):
    service, host = worker
    engine = service.engine
    assert engine.pool.layout.num_pages == 256
    release = threading.Event()

    def hold_the_engine(request_id, logits):
        assert release.wait(HANG_GUARD_S), "the test never released the engine"

    async def metrics():
        return await scrape(host.http_address)

    engine.on_logits = hold_the_engine
    try:
        async with aio.insecure_channel(host.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            first = asyncio.create_task(generate(stub, "a", [5, 6, 7, 8]))
            await poll_until(
                metrics,
                lambda m: m.value("loramesh_gpu_worker_adapter_requests_running", adapter="a") == 1,
                "a's request runs",
            )
            second = asyncio.create_task(generate(stub, "b", [9, 10, 11]))
            before = time.time()
            # b's request counts as waiting from the moment it asks for b's host copy; wait for
            # that copy too (the engine is held, so nothing else can change meanwhile).
            during = await poll_until(
                metrics,
                lambda m: lora_info(m)["waiting_lora_adapters"] == "b" and "b" in loaded_levels(m),
                "b's request waits with b in host RAM",
            )
            # max_running=1: the held engine has a's request in its batch; b's waits for it.
            assert lora_info(during) == {
                "running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "1"
            }  # fmt: skip
            assert during.value("vllm:lora_requests_info") >= before  # a timestamp, like vLLM's
            labels = {"model_name": service.servicer.describe["model"], "engine": "0"}
            assert during.value("vllm:num_requests_running", **labels) == 1
            assert during.value("vllm:num_requests_waiting", **labels) == 1
            assert during.by_label("loramesh_gpu_worker_adapter_requests_running", "adapter") == {"a": 1}
            assert during.by_label("loramesh_gpu_worker_adapter_requests_waiting", "adapter") == {"b": 1}
            # a's 128 pages are in use and its request holds KV pages: over half the pool.
            assert 0.5 < during.value("vllm:kv_cache_usage_perc", **labels) <= 1
            assert loaded_levels(during) == {"a": "gpu", "b": "cpu"}
            assert during.value("vllm:num_gpu_loaded_lora_adapters", **labels) == 1
            assert during.value("vllm:num_cpu_loaded_lora_adapters", **labels) == 2
            assert during.value("loramesh_gpu_worker_lora_mode_merged") == 0  # fcfs never merges
            assert during.value("loramesh_gpu_worker_aborted_requests_total") == 0

            release.set()
            await asyncio.gather(first, second)
            after = await poll_until(
                metrics, lambda m: m.value("vllm:num_requests_running") == 0, "both requests finished"
            )
            assert lora_info(after) == {
                "running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"
            }  # fmt: skip
            assert after.value("vllm:num_requests_waiting") == 0
            assert after.series("loramesh_gpu_worker_adapter_requests_running") == []
            assert after.by_label("loramesh_gpu_worker_adapter_generated_tokens_total", "adapter") == {
                "a": MAX_TOKENS,
                "b": MAX_TOKENS,
            }
            # b's page-in filled the pool; its KV then evicted idle a: a is left in host RAM only.
            assert loaded_levels(after) == {"a": "cpu", "b": "gpu"}
            for level in ("cpu", "gpu"):
                assert after.value("loramesh_gpu_worker_adapter_load_seconds_count", level=level) == 2

            await generate(stub, "c", [12, 13])
            # c's host copy took the budget past 1 MiB: a, used least recently, is dropped and
            # its series is gone; c's KV evicted idle b from the pool.
            last = await poll_until(metrics, lambda m: "c" in loaded_levels(m), "c is loaded")
            assert loaded_levels(last) == {"b": "cpu", "c": "gpu"}
            assert last.value("vllm:num_cpu_loaded_lora_adapters") == 2
    finally:
        release.set()  # a failed assertion must not leave the engine thread waiting


def dashboard_series(expression: str) -> set[str]:
    """The series names a PromQL expression reads (identifiers followed by ``{``, ``[`` or an
    end, minus functions and keywords)."""
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?=\s*[{\[)\s,]|$)", expression))
    return {n for n in names if n.startswith(("vllm:", "loramesh_"))}


async def test_the_dashboard_reads_only_series_a_worker_or_a_gateway_serves(worker):
    _, host = worker
    quota = QuotaMetrics(lambda: TenantQuota())
    gateway = {family.name for family in (*RequestMetrics().collect(), *quota.collect())}
    served = (await scrape(host.http_address)).family_names | gateway
    panels = json.loads(DASHBOARD.read_text())["panels"]
    read = {
        re.sub(r"_(bucket|sum|count|total)$", "", name)
        for p in panels
        for t in p.get("targets", [])
        for name in dashboard_series(t["expr"])
    }
    assert read, "the dashboard queries nothing"
    assert sorted(read - served) == []
