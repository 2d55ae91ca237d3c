"""The mesh the campaign fuzzes: every service as a real process, all with mutual TLS.

etcd (client-certificate auth), the adapter store, the scheduler, a kv_manager, the gateway
(two tenants by API key, path loads allowed under one directory, which only alice's
import policy grants) and, optionally, a worker on
the real model. Every identity the mesh issues has a certificate under ``root/certs``, so the
campaign can call each port as each of them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.ports import free_port
from services.runtime.process.process import ServiceProcess
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import KINDS

TENANT_KEYS = {"key-alice-fuzz": "alice", "key-bob-fuzz": "bob"}
"""The gateway's API keys: the two tenants."""
WORKER_INSTANCE = "gpu_worker/worker-0"


@dataclass
class FuzzMesh:
    etcd: EtcdServer
    processes: dict[str, ServiceProcess]
    """By service name."""
    certs: CertificateDirectory
    openai_port: int
    load_dir: Path
    """Where ``POST /v1/load_lora_adapter`` may read (``--adapter-load-dirs``)."""

    @property
    def openai_url(self) -> str:
        return f"https://127.0.0.1:{self.openai_port}"

    def dead(self) -> list[str]:
        """The services whose process has exited."""
        return [
            name for name, proc in self.processes.items() if proc.proc is None or proc.proc.poll() is not None
        ]

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            proc.kill()
        self.etcd.stop()


async def start_fuzz_mesh(root: Path, worker: bool, startup_timeout_s: float = 300) -> FuzzMesh:
    """Every service started and ready; a worker on the default model if ``worker``."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    certs = create_mesh_certificates(root / "certs", (*KINDS, WORKER_INSTANCE))
    etcd = EtcdServer(root / "etcd", tls=certs.tls_for("etcd"))
    etcd.start()
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps(TENANT_KEYS))
    load_dir = root / "load"
    load_dir.mkdir()
    policy_file = root / "import-policy.json"
    policy_file.write_text(json.dumps({"tenants": {"alice": [load_dir.resolve().as_uri()]}}))
    common = ["--etcd-endpoints", etcd.endpoint]
    openai_port = free_port("127.0.0.1")

    def service(name: str, flags: list[str], identity: str | None = None) -> ServiceProcess:
        return ServiceProcess(
            name, [*common, *flags], log_path=logs / f"{name}.log", tls=certs.tls_for(identity or name)
        )

    processes = {
        "adapter_store": service(
            "adapter_store", ["--data-dir", str(root / "store"), "--import-policy-file", str(policy_file)]
        ),
        "scheduler": service("scheduler", []),
        "kv_manager": service("kv_manager", []),
        "gateway": service(
            "gateway",
            [
                "--api-keys-file",
                str(keys_file),
                "--openai-port",
                str(openai_port),
                "--adapter-load-dirs",
                str(load_dir),
            ],
        ),
    }
    if worker:
        processes["gpu_worker"] = service(
            "gpu_worker",
            ["--dtype", "float32", "--pool-mib", "192", "--instance-id", "worker-0", "--threads", "1"],
            WORKER_INSTANCE,
        )
    mesh = FuzzMesh(etcd, processes, certs, openai_port, load_dir)
    try:
        for proc in processes.values():
            proc.start()
        await asyncio.gather(*(p.wait_ready(startup_timeout_s) for p in processes.values()))
    except BaseException:
        mesh.stop()
        raise
    return mesh
