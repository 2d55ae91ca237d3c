"""The whole mesh as real processes: etcd, adapter store, workers, scheduler, gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loramesh.tls import ClientTLS
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.ports import free_port
from services.runtime.process.process import ServiceProcess
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import KINDS
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel

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
    certs: CertificateDirectory | None = None
    """With mutual TLS: the mesh's certificates (None: plaintext)."""

    @property
    def operator_tls(self) -> TLSConfig:
        """What a test presents to the mesh's internal ports: the ``operator`` identity (or
        plaintext)."""
        return self.certs.tls_for("operator") if self.certs is not None else NO_TLS

    @property
    def client_tls(self) -> ClientTLS | None:
        """The SDK's TLS option for this mesh, a tenant's: the CA alone (None: plaintext)."""
        return ClientTLS(str(self.certs.ca_file)) if self.certs is not None else None

    @property
    def openai_base_url(self) -> str:
        """With TLS the port speaks HTTPS only (verify with ``operator_tls.ca_file``)."""
        scheme = "https" if self.certs is not None else "http"
        return f"{scheme}://127.0.0.1:{self.openai_port}/v1"

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
    tls: bool = False,
    store_flags: tuple[str, ...] = (),
) -> Mesh:
    """Start every process; with ``tls`` all of them (etcd with client-cert auth included) run
    with mutual TLS on certificates made in ``root/certs``."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Each worker its own certificate (gpu_worker/<instance>), as `loramesh up --tls` issues.
    instances = [f"gpu_worker/worker-{i}" for i in range(workers)]
    certs = create_mesh_certificates(root / "certs", (*KINDS, *instances)) if tls else None

    def tls_for(identity: str) -> TLSConfig:
        return certs.tls_for(identity) if certs is not None else NO_TLS

    etcd = EtcdServer(root / "etcd", tls=tls_for("etcd"))
    etcd.start()
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    common = ["--etcd-endpoints", etcd.endpoint]
    store = ServiceProcess(
        "adapter_store",
        [*common, "--data-dir", str(root / "store"), *store_flags],
        log_path=logs / "store.log",
        tls=tls_for("adapter_store"),
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
            tls=tls_for(instances[i]),
        )
        for i in range(workers)
    ]
    scheduler = ServiceProcess(
        "scheduler", [*common, *scheduler_flags], log_path=logs / "scheduler.log", tls=tls_for("scheduler")
    )
    openai_port = free_port("127.0.0.1")
    gateway = ServiceProcess(
        "gateway",
        [*common, "--api-keys-file", str(keys_file), "--openai-port", str(openai_port), *gateway_flags],
        log_path=logs / "gateway.log",
        tls=tls_for("gateway"),
    )
    processes = [store, *worker_procs, scheduler, gateway]
    mesh = Mesh(etcd, store, worker_procs, scheduler, gateway, processes, openai_port, certs)
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
    from mesh_api.v1 import scheduler_pb2, scheduler_pb2_grpc

    async with aio_channel(mesh.scheduler.address, mesh.operator_tls) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for _ in range(int(timeout_s * 10)):
            view = await stub.ClusterView(scheduler_pb2.ClusterViewRequest())
            if len(view.workers) == count:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the scheduler never saw {count} workers")


@contextlib.contextmanager
def running_mesh(root: Path, workers: int, worker_flags: tuple[str, ...] = ()) -> Iterator[Mesh]:
    """A mesh (:func:`start_mesh`) whose ``workers`` the scheduler sees, for a module fixture's
    ``with``; stopped when the block ends, or at once when the workers never show."""

    async def start() -> Mesh:
        started = await start_mesh(root, workers=workers, worker_flags=worker_flags)
        try:
            await wait_for_workers(started, workers)
        except BaseException:
            started.stop()
            raise
        return started

    mesh = asyncio.run(start())
    try:
        yield mesh
    finally:
        mesh.stop()
