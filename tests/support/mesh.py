"""The whole mesh as real processes: etcd, adapter store, workers, scheduler, gateway."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime.etcd_server import EtcdServer, free_port
from services.runtime.process import ServiceProcess

KEYS = {"key-alice": "alice", "key-bob": "bob"}


@dataclass
class Mesh:
    etcd: EtcdServer
    store: ServiceProcess
    workers: list[ServiceProcess]
    scheduler: ServiceProcess
    gateway: ServiceProcess
    processes: list[ServiceProcess] = field(default_factory=list)
    openai_port: int = 0
    """The gateway's OpenAI-compatible HTTP API."""

    @property
    def openai_base_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}/v1"

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.kill()
        self.etcd.stop()


async def start_mesh(
    root: Path,
    workers: int = 2,
    scheduler_flags: tuple[str, ...] = (),
    worker_flags: tuple[str, ...] = (),
    gateway_flags: tuple[str, ...] = (),
) -> Mesh:
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer(root / "etcd")
    etcd.start()
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    common = ["--etcd-endpoints", etcd.endpoint]
    store = ServiceProcess(
        "adapter_store", [*common, "--data-dir", str(root / "store")], log_path=logs / "store.log"
    )
    worker_procs = [
        ServiceProcess(
            "gpu_worker",
            [
                *common,
                "--dtype",
                "float32",
                "--pool-mib",
                "192",
                "--instance-id",
                f"worker-{i}",
                "--threads",
                "1",
                *worker_flags,
            ],
            log_path=logs / f"worker-{i}.log",
        )
        for i in range(workers)
    ]
    scheduler = ServiceProcess("scheduler", [*common, *scheduler_flags], log_path=logs / "scheduler.log")
    openai_port = free_port("127.0.0.1")
    gateway = ServiceProcess(
        "gateway",
        [*common, "--api-keys-file", str(keys_file), "--openai-port", str(openai_port), *gateway_flags],
        log_path=logs / "gateway.log",
    )
    processes = [store, *worker_procs, scheduler, gateway]
    mesh = Mesh(etcd, store, worker_procs, scheduler, gateway, processes, openai_port)
    try:
        for proc in processes:
            proc.start()
        await asyncio.gather(*(p.wait_ready(180) for p in processes))
    except BaseException:
        mesh.stop()
        raise
    return mesh


async def wait_for_workers(mesh: Mesh, count: int, timeout_s: float = 120) -> None:
    """Until the scheduler's view holds ``count`` workers with load reports. ``timeout_s`` only
    guards against a hang: workers loading the model on a busy 2-core machine can take a while."""
    from grpc import aio

    from loramesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    async with aio.insecure_channel(mesh.scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for _ in range(int(timeout_s * 10)):
            view = await stub.ClusterView(scheduler_pb2.ClusterViewRequest())
            if len(view.workers) == count:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the scheduler never saw {count} workers")
