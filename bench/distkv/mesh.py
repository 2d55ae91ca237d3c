"""The configurations compared, started as real processes: a fresh etcd, a kv_manager where the
configuration has one, and gpu_workers run exactly as an operator runs them
(``python -m services.<name> --flags``)."""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from bench.distkv.config import MeshSettings
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig, read_loads
from services.runtime.process.ports import free_port
from services.runtime.process.process import ServiceProcess

READY_GUARD_S = 300.0
"""Hang guard for starting the processes (a loaded 2-core machine loads three models slowly)."""


@dataclass(frozen=True)
class Configuration:
    """One configuration of the comparison."""

    name: str
    """borrow, preempt, alone or all-local."""
    kv_overflow: str
    """The workers' ``--kv-overflow``."""
    kv_manager: bool
    """A kv_manager runs (borrowers ask it for creditors)."""
    lends: bool
    """Workers lend blocks (``--lend-cap-blocks`` from the settings, else 0)."""
    workers: int | None = None
    """Workers started (None: the settings' count)."""
    large_pool: bool = False
    """Each worker gets the all-local pool instead of the small one."""


BORROW = Configuration("borrow", "borrow", kv_manager=True, lends=True)
"""DistKV-LLM: a worker whose pool is full borrows blocks from the others."""
PREEMPT = Configuration("preempt", "preempt", kv_manager=True, lends=True)
"""The same mesh with --kv-overflow preempt: a full pool preempts and recomputes, never borrows."""
ALONE = Configuration("alone", "preempt", kv_manager=False, lends=False)
"""Each worker alone: no kv_manager, nothing lent."""
ALL_LOCAL = Configuration("all-local", "preempt", kv_manager=False, lends=False, workers=1, large_pool=True)
"""One worker whose pool holds every batch it gets: all KV local."""


class Mesh:
    """A started configuration; ``async with`` starts it and kills every process on exit."""

    def __init__(self, configuration: Configuration, settings: MeshSettings, log_dir: Path):
        self.configuration = configuration
        self.settings = settings
        self.log_dir = log_dir / configuration.name
        self.etcd: EtcdServer | None = None
        self.workers: list[ServiceProcess] = []
        self.worker_ids: list[str] = []
        self.lane_ports: list[int] = []
        """Each worker's TCP lending lane port, chosen here with ``creditor_host`` (the proxy
        forwards it), else empty (any free port)."""
        self.kv_manager: ServiceProcess | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="distkv-bench-")

    @property
    def membership(self) -> MembershipConfig:
        return MembershipConfig(etcd_endpoints=self.etcd.endpoint)

    async def __aenter__(self) -> Self:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(self._scratch.name)
        self.etcd = EtcdServer(scratch / "etcd").start()
        try:
            await self._start(scratch)
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self, scratch: Path) -> None:
        config, settings = self.configuration, self.settings
        etcd_flags = ["--etcd-endpoints", self.etcd.endpoint]
        if config.kv_manager:
            self.kv_manager = ServiceProcess(
                "kv_manager", etcd_flags, log_path=self.log_dir / "kv_manager.log"
            ).start()
        adapters = scratch / "adapters"
        adapters.mkdir()
        pool = settings.local_pool_mib if config.large_pool else settings.pool_mib
        for index in range(config.workers or settings.workers):
            worker_id = f"gpu_worker-{config.name}-{index}"
            flags = [
                *etcd_flags, "--instance-id", worker_id, "--adapter-dir", str(adapters),
                "--dtype", settings.dtype, "--pool-mib", str(pool), "--threads", str(settings.threads),
                "--kv-overflow", config.kv_overflow, "--lending-lane", settings.lending_lane,
                "--lend-cap-blocks", str(settings.lend_cap_blocks if config.lends else 0),
                "--lease-ttl-s", "30",  # a busy 2-core machine must not expire a worker's lease
            ]  # fmt: skip
            if index and settings.creditor_host:
                flags += ["--advertise-host", settings.creditor_host]
            if settings.creditor_host:
                self.lane_ports.append(free_port())
                flags += ["--lending-lane-port", str(self.lane_ports[-1])]
            log_path = self.log_dir / f"{worker_id}.log"
            self.workers.append(ServiceProcess("gpu_worker", flags, log_path=log_path).start())
            self.worker_ids.append(worker_id)
        processes = [p for p in (self.kv_manager, *self.workers) if p is not None]
        await asyncio.gather(*(p.wait_ready(READY_GUARD_S) for p in processes))
        await self.wait_quiet()

    async def wait_quiet(self) -> dict[str, dict]:
        """Until every worker's heartbeat shows its whole pool free, nothing lent or borrowed
        (the state a probe or a run starts from); returns those heartbeats."""
        while True:
            loads = await read_loads(self.membership)
            mine = [loads.get(w) for w in self.worker_ids]
            if all(
                load
                and load.get("total_blocks")
                and load.get("free_blocks") == load.get("total_blocks")
                and not load.get("lent_blocks")
                and not load.get("borrowed_blocks")
                for load in mine
            ):
                return {w: loads[w] for w in self.worker_ids}
            await asyncio.sleep(0.5)

    async def loads(self) -> dict[str, dict]:
        """The workers' latest heartbeats."""
        loads = await read_loads(self.membership)
        return {w: loads[w] for w in self.worker_ids if w in loads}

    def stop(self) -> None:
        for process in [*self.workers, self.kv_manager]:
            if process is not None:
                process.kill()
        if self.etcd is not None:
            self.etcd.stop()
        self._scratch.cleanup()
