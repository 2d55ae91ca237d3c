"""Start a service as a child process and wait until it reports ready.

Used by ``loramesh up`` and by the integration tests, so both run services exactly the way
an operator does: ``python -m services.<name> --flags``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime.process.child_environment import child_environment
from services.runtime.process.ports import free_port
from services.runtime.rpc.server import check_health
from services.runtime.security.tls import NO_TLS, TLSConfig

#: Proto service name each service reports readiness under.
GRPC_SERVICE_NAMES = {
    "adapter_store": "loramesh.v1.AdapterStore",
    "gpu_worker": "loramesh.v1.Worker",
    "gateway": "loramesh.v1.Gateway",
    "kv_manager": "loramesh.v1.KVManager",
    "scheduler": "loramesh.v1.Scheduler",
}


class ServiceStartError(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    """One ``python -m services.<module>`` child with its own ports and log file."""

    module: str
    """Service package under ``services``, e.g. ``adapter_store``."""
    args: list[str] = field(default_factory=list)
    """Extra flags for the service."""
    log_path: Path | None = None
    """Where its stderr/stdout go (default: inherit)."""
    host: str = "127.0.0.1"
    port: int = 0
    http_port: int = 0
    env: dict[str, str] | None = None
    """Variables set for it on top of what it takes from this process's environment: the
    allow-list of :func:`~services.runtime.process.child_environment.child_environment`."""
    settings: Collection[str] | None = None
    """The ``LORAMESH_*`` variables it takes from this process's environment (its config's
    ``setting_variables``); None: all of them."""
    tls: TLSConfig = NO_TLS
    """Its mutual TLS settings (passed as ``--tls-*`` flags; the readiness probe uses them too)."""
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port(self.host)
        self.http_port = self.http_port or free_port(self.host)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", f"services.{self.module}",
            "--host", self.host, "--port", str(self.port), "--http-port", str(self.http_port),
            *self.tls.flags(), *self.args,
        ]  # fmt: skip

    def start(self) -> ServiceProcess:
        env = {**child_environment(os.environ, self.module, self.settings), **(self.env or {})}
        if self.log_path is None:
            self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
            return self
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll grpc.health.v1 for the service's readiness key until SERVING."""
        deadline = time.monotonic() + timeout_s
        name = GRPC_SERVICE_NAMES[self.module]
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceStartError(
                    f"{self.module} exited with code {self.proc.returncode}{self._log_hint()}"
                )
            if await check_health(self.address, name, timeout=1.0, tls=self.tls) == "SERVING":
                return
            await asyncio.sleep(0.1)
        raise ServiceStartError(f"{self.module} not ready after {timeout_s:.0f}s{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log_path and self.log_path.exists():
            tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
            return "; log tail:\n" + "\n".join(tail)
        return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait for the graceful exit; SIGKILL if it does not come. Returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
