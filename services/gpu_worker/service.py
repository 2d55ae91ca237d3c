"""The gpu_worker as a runtime :class:`~services.runtime.rpc.server.Service`."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import torch
from grpc import aio

from mesh_api.v1 import worker_pb2_grpc
from mesh_api.v1.types_pb2 import WorkerLoad
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import AdapterSource, DirectorySource, StoreSource
from services.gpu_worker.build import build_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.distkv.transport.kv_manager_directory import KvManagerDirectory
from services.gpu_worker.distkv.transport.lane_modes import LANE_MODES
from services.gpu_worker.distkv.transport.lending_lane import LaneServer
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.side_threads import confine_to_one_thread, side_thread_pool
from services.gpu_worker.kernels import cpu_quant
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.pin_refresh import refresh_pins
from services.gpu_worker.prefix_tier import PrefixTierSettings
from services.gpu_worker.prefix_tier_setup import PrefixTierParts, kv_identity, start_prefix_tier
from services.gpu_worker.quantization_setting import resolve_quantization
from services.gpu_worker.servicer import WorkerServicer
from services.gpu_worker.version_prefetch import VersionPrefetch, follow_publishes
from services.gpu_worker.worker_metrics import WorkerMetrics, WorkerParts
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.etcd.membership import MemberInfo, MembershipConfig, follow, watch_members
from services.runtime.etcd.worker_load import worker_load_to_report
from services.runtime.eviction import make_eviction_policy
from services.runtime.field_copy import message_of

log = logging.getLogger("loramesh.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls run on native units (AVX-512 BF16 or AMX); otherwise they are emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def lane_mode(requested: str, tls: bool, device: torch.device) -> str:
    """The ``--lending-lane`` in force: shared memory only for a CPU pool with TLS off (a mapped
    pool is readable whole, which TLS's per-identity checks would not allow), else the socket."""
    if requested not in LANE_MODES:
        raise ValueError(f"--lending-lane must be one of {', '.join(LANE_MODES)}, not {requested!r}")
    if requested == "shared-memory" and (tls or device.type != "cpu"):
        log.info("--lending-lane shared-memory needs a CPU pool and TLS off: the socket lane instead")
        return "socket"
    return requested


def _weights_format(quantization: str) -> str:
    """How the base weights are multiplied, for the start-up log: the format and, quantized, the
    vector path the native kernels were built for."""
    if quantization == "none":
        return "dequantized"
    return f"{quantization}, {cpu_quant.kernels().isa} kernels"


class WorkerService:
    name = "gpu_worker"
    grpc_service_name = "loramesh.v1.Worker"

    def __init__(self, config: WorkerConfig):
        # Resolved here so the engine lends and borrows under the id the mesh knows it by.
        config.instance_id = config.resolved_instance_id(self.name)
        self.config = config
        self.servicer = WorkerServicer()
        self.engine: Engine | None = None
        self.lane = config.lending_lane
        """The --lending-lane in force (resolved at start: see :func:`lane_mode`)."""
        self.source: AdapterSource | None = None
        self.directory = KvManagerDirectory(
            (config.kv_manager,) if config.kv_manager else (), tls=config.tls()
        )
        self._watches: list[asyncio.Task] = []
        self._workers: dict[str, float] = {}
        """Live workers: instance id -> the start time of the process registered under it."""
        self._parts: WorkerParts | None = None
        self._prefix_tier: PrefixTierParts | None = None
        self.metrics = WorkerMetrics(lambda: self._parts, config.metric_adapter_labels)

    def metric_collectors(self) -> tuple[WorkerMetrics, ...]:
        """Per-adapter, router-facing and DistKV series beside the load report's gauges."""
        return (self.metrics,)

    def add_to_server(self, server: aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)

    def fence_by_lease(self, fence: LeaseFence) -> None:
        """Refuse new requests and loans while ``fence`` (this worker's etcd lease) is up; the
        runtime makes readiness follow it too (services/runtime/rpc/server.py)."""
        self.servicer.lease_fence = fence

    async def start(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # The event loop's thread serial too (the engine's constructor fills its pool here): a team
        # of its own would idle beside the engine's and throttle every barrier of every step.
        confine_to_one_thread()
        # Every to_thread call (model loading, adapter parsing, lending RPCs) on confined threads:
        # only the engine's thread may start an OpenMP team (engine/side_threads.py).
        asyncio.get_running_loop().set_default_executor(
            side_thread_pool(min(32, (os.cpu_count() or 1) + 4), "worker-io")
        )
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        quantization = resolve_quantization(cfg.quantization, device.type, cfg.tp, cfg.model or None)
        loaded = await asyncio.to_thread(load_model, cfg.model or None, quantization=quantization)
        lane = self.lane = lane_mode(cfg.lending_lane, tls=cfg.tls().enabled, device=device)

        def connect(creditor: str, address: str) -> GrpcCreditorTransport:
            return GrpcCreditorTransport(
                creditor, address, engine.pool.layout, engine.distkv, tls=cfg.tls(), lane=lane, dtype=dtype
            )

        engine = await asyncio.to_thread(
            build_engine, cfg, loaded, device=device, dtype=dtype,
            shared_pool=lane == "shared-memory" and cfg.tp == 1, creditors=self.directory, connect=connect,
        )  # fmt: skip
        engine.start()
        self.engine = engine
        if cfg.etcd_endpoints:
            membership = MembershipConfig(etcd_endpoints=cfg.etcd_endpoints, tls=cfg.tls())
            self._watches = [
                asyncio.create_task(follow(watch_members(membership, self.name), self._set_workers)),
                asyncio.create_task(follow(watch_members(membership, "kv_manager"), self._set_kv_managers)),
            ]
        if cfg.adapter_dir:
            self.source = DirectorySource(cfg.adapter_dir)
        else:
            self.source = StoreSource(
                cfg.adapter_store, cfg.etcd_endpoints, cfg.tls(), read_blob_files=cfg.store_fetch == "auto"
            )
        loader = AdapterLoader(
            self.source,
            engine,
            dtype,
            cfg.host_cache_mib * 2**20 if cfg.host_cache_mib else None,
            make_eviction_policy(cfg.eviction_policy),
        )
        if cfg.pin_refresh_s > 0:
            self._watches.append(asyncio.create_task(refresh_pins(self.source, loader, cfg.pin_refresh_s)))
        if cfg.prefetch_versions_s > 0 and cfg.etcd_endpoints and not cfg.adapter_dir:
            prefetch = VersionPrefetch(loader, engine.preload, cfg.prefetch_versions_s)
            self._watches.append(asyncio.create_task(follow_publishes(membership, prefetch)))
        self.metrics.attach(engine, loader)
        self._parts = WorkerParts(engine, loader, loaded.config.name)
        describe = {
            "model": loaded.config.name,
            "dtype": str(dtype).removeprefix("torch."),
            "tp": cfg.tp,
            "quantization": quantization,
        }
        if cfg.tp > 1:
            log.info(
                "tensor-parallel group of %d ranks; fallbacks: %s",
                cfg.tp,
                ", ".join(engine.fallbacks) or "none",
            )
        if cfg.deterministic:
            log.info("deterministic serving: batch-invariant numerics")
        self.servicer.attach(engine, loader, describe)
        self._start_prefix_tier(engine, loaded.config.name, dtype, quantization)
        if lane != "off" and engine.lending.max_lent_blocks:
            self.servicer.lane = LaneServer(
                engine.lending, engine.pool.device, shared_pool=engine.pool,
                tcp_host=cfg.host, tcp_port=cfg.lending_lane_port, tls=cfg.tls(),
            )  # fmt: skip
        log.info(
            "model %s on %s (%s, base weights %s); pool %d pages of %d elements",
            loaded.config.name, device, describe["dtype"], _weights_format(quantization),
            engine.pool.layout.num_pages, engine.pool.page_elems,
        )  # fmt: skip

    def _start_prefix_tier(self, engine: Engine, model: str, dtype: torch.dtype, quantization: str) -> None:
        """Join the cluster prefix tier (--cluster-prefix-cache on) when there is a prefix cache,
        one rank (a tensor-parallel rank's pool holds a shard of each block) and a mesh."""
        cfg = self.config
        if cfg.cluster_prefix_cache == "off" or engine.prefix_cache is None or cfg.tp > 1:
            return
        if not (cfg.etcd_endpoints or cfg.kv_manager):  # standalone: no index to announce to
            return
        identity = kv_identity(model, dtype, quantization, engine.pool.layout.kv_block_tokens)
        self._prefix_tier = start_prefix_tier(
            engine, PrefixTierSettings(cfg.instance_id, identity), lambda: self.directory.addresses,
            prefix_fetch_mb_s=cfg.prefix_fetch_mb_s, prefill_gflops=cfg.prefill_gflops, tls=cfg.tls(),
        )  # fmt: skip
        self.servicer.prefix_tier = self.metrics.prefix_tier = self._prefix_tier.tier

    def _set_workers(self, members: dict[str, MemberInfo]) -> None:
        """A worker whose lease expired is gone: reclaim what we lent it, recompute what we
        borrowed from it. So is one registered again by a new process under the same id (a pod
        restarted in place keeps its name, and its new key may replace the old before that
        lease expires): the new process holds none of its predecessor's loans."""
        live = {w: m.started_at for w, m in members.items()}
        gone = [w for w, started in self._workers.items() if live.get(w) != started]
        self._workers = live
        for worker_id in gone:
            reclaimed = self.engine.lending.reclaim(worker_id)
            if reclaimed:
                log.info("worker %s is gone: reclaimed %d blocks lent to it", worker_id, reclaimed)
            self.engine.worker_gone(worker_id)

    def _set_kv_managers(self, members: dict[str, MemberInfo]) -> None:
        if not self.config.kv_manager:
            self.directory.addresses = tuple(m.address for m in members.values())

    async def stop(self) -> None:
        for watch in self._watches:
            watch.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        if self._prefix_tier is not None:
            await self._prefix_tier.close()
        self.directory.close()
        if self.servicer.lane is not None:
            self.servicer.lane.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.source is not None:
            await self.source.close()

    def load_report(self) -> dict:
        """The heartbeat: a ``WorkerLoad`` as JSON (DESIGN §4 keys plus the KV block ledger's)."""
        if self.engine is None:
            return {"ready": False}
        engine, stats = self.engine, self.engine.stats()
        load = message_of(
            WorkerLoad,
            stats,
            lent_blocks=engine.lending.lent_to(),
            lend_cap_blocks=engine.lending.max_lent_blocks,
            topology=self.config.topology,
            dgfm_recalls=engine.recalls.recalls,
            dgfm_blocks_recalled=engine.recalls.blocks_recalled,
            kv_manager_term=self.servicer.leader_fence.term,
            kv_manager_leader=self.servicer.leader_fence.leader,
            leader_writes_accepted=self.servicer.leader_fence.accepted,
            leader_writes_refused=self.servicer.leader_fence.refused,
        )
        load.MergeFrom(message_of(WorkerLoad, engine.distkv.totals()))  # the DistKV traffic's fields
        report = worker_load_to_report(load)
        # Beside WorkerLoad's fields (readers ignore unknown keys; `loramesh status` prints them):
        # a tensor-parallel group's degree, what the engine could not do and fell back from, and
        # its KV overflow policy and lending lane.
        if self.config.tp > 1:
            report["tp"] = self.config.tp
        if stats.fallbacks:
            report["fallbacks"] = ",".join(stats.fallbacks)
        # The KV overflow policy in force: borrow only where the engine runs a borrower (a
        # tensor-parallel group falls back to preempt).
        report["kv_overflow"] = "borrow" if self.engine.borrower is not None else "preempt"
        report["lending_lane"] = self.lane
        # The base weights' format and the activation dtype in force (what `loramesh up` says),
        # known once start() has loaded the model.
        report.update({k: v for k, v in self.servicer.describe.items() if k in ("quantization", "dtype")})
        return report
