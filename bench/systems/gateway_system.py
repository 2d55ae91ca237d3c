"""loramesh as users run it (system a): etcd, adapter store, one worker, scheduler and gateway as
separate processes on this machine, driven through the Python SDK over gRPC.

The adapters are uploaded through the gateway before the clock starts; at run time the worker
pulls each one from the store (RAM tier, else the store's disk) when a request needs it. The
scheduler's queue bound is lifted so that, like the other systems, it queues every request of a
saturating trace instead of refusing some (its admission control is measured in bench/HISTORY.md).
Prompts go as text: the prompt token ids decoded by the model's tokenizer, so the gateway's
re-tokenization may give slightly different lengths.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.systems.base import RequestRecord, RunContext
from bench.systems.clock import time_left
from loramesh.async_client import AsyncClient
from loramesh.errors import LoraMeshError
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.process import ServiceProcess

UPLOAD_CONCURRENCY = 4


@dataclass(frozen=True)
class GatewaySystemOptions:
    name: str = "loramesh-gateway"
    """Label in tables and plots."""
    startup_timeout_s: float = 300.0
    """How long the services may take to become ready."""


class GatewaySystem:
    def __init__(self, options: GatewaySystemOptions = GatewaySystemOptions()):
        self.options = options
        self.name = options.name

    def run(self, context: RunContext) -> list[RequestRecord]:
        tokenizer = load_tokenizer(context.model_path).tokenizer
        with tempfile.TemporaryDirectory(prefix="loramesh-bench-mesh-") as root:
            return asyncio.run(self._run(context, Path(root), tokenizer))

    async def _run(self, context: RunContext, root: Path, tokenizer) -> list[RequestRecord]:
        etcd = EtcdServer(root / "etcd")
        etcd.start()
        processes: list[ServiceProcess] = []
        api_key = "lm-bench-" + secrets.token_urlsafe(12)
        try:
            endpoint = ["--etcd-endpoints", etcd.endpoint]
            model = ["--model", context.model_path] if context.model_path else []
            store = ServiceProcess(
                "adapter_store",
                [*endpoint, *model, "--data-dir", str(root / "store"),
                 "--ram-budget-mib", str(int(context.host_cache_mib))],
                log_path=root / "store.log",
            ).start()  # fmt: skip
            processes.append(store)
            await store.wait_ready(self.options.startup_timeout_s)
            worker = ServiceProcess(
                "gpu_worker",
                [*endpoint, *model, "--adapter-store", store.address, "--pool-mib", str(context.pool_mib),
                 "--max-running", str(context.max_batch), "--host-cache-mib", str(int(context.host_cache_mib)),
                 "--threads", str(os.cpu_count() or 1)],
                log_path=root / "worker.log",
            ).start()  # fmt: skip
            scheduler = ServiceProcess(
                "scheduler", [*endpoint, "--max-queue-per-worker", "1000000"], log_path=root / "scheduler.log"
            ).start()
            processes += [worker, scheduler]
            await asyncio.gather(*(p.wait_ready(self.options.startup_timeout_s) for p in (worker, scheduler)))
            gateway = ServiceProcess(
                "gateway",
                [*endpoint, *model, "--adapter-store", store.address, "--scheduler", scheduler.address],
                log_path=root / "gateway.log",
                env={"LORAMESH_API_KEYS": f"{api_key}=bench"},
            ).start()
            processes.append(gateway)
            await gateway.wait_ready(self.options.startup_timeout_s)
            async with AsyncClient(gateway.address, api_key, timeout=None, retries=0) as client:
                await upload_adapters(client, context)
                return await _replay(client, context, tokenizer)
        finally:
            for proc in reversed(processes):
                await asyncio.to_thread(proc.terminate)
            etcd.stop()


async def upload_adapters(client: AsyncClient, context: RunContext) -> None:
    """Register every adapter of ``context.adapters`` under its name, a few at a time."""
    limit = asyncio.Semaphore(UPLOAD_CONCURRENCY)

    async def upload(index: int) -> None:
        async with limit:
            await client.adapters.upload(context.adapters.directory(index), context.adapters.name(index))

    # Every adapter of the set is registered, as a tenant would have them all.
    await asyncio.gather(*(upload(i) for i in range(context.adapters.count)))


async def _replay(client: AsyncClient, context: RunContext, tokenizer) -> list[RequestRecord]:
    records = [
        RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len) for r in context.trace
    ]
    start = time.monotonic()
    deadline = start + context.window_s

    async def serve(request, record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, start + request.time_s - time.monotonic()))
        try:
            await asyncio.wait_for(stream(request, record), timeout=time_left(deadline, time.monotonic()))
        except TimeoutError:
            pass
        except LoraMeshError as error:  # a refused or failed request is recorded, the run goes on
            record.error = f"{type(error).__name__}: {error}"
        finally:
            context.on_progress(1)

    async def stream(request, record: RequestRecord) -> None:
        prompt = tokenizer.decode(list(context.prompt(request)))
        async for delta in client.stream(
            prompt,
            adapter=context.adapters.name(request.adapter),
            max_tokens=request.output_len,
            ignore_eos=True,
        ):
            now = time.monotonic() - start
            if delta.token_ids:
                record.output_tokens += len(delta.token_ids)
                if record.first_token_s is None:
                    record.first_token_s = now
            if delta.finish_reason is not None and record.output_tokens >= record.output_len:
                record.finish_s = now

    await asyncio.gather(*(serve(r, rec) for r, rec in zip(context.trace, records)))
    return records
