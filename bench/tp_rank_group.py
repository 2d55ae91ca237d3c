"""A tensor-parallel group of N local processes over gloo, driven step by step from the parent
(tests and the bench; the serving executor broadcasts its plans itself).

Each rank process joins a ``torch.distributed`` group (a TCP store on a free loopback port),
builds its shard model and a pool of its ``kv_dim`` with the same number of pages as every other
rank, and then obeys the parent's commands, sent to every rank over its own pipe: page an
adapter (each rank shards it; the reply names its placement), run a step (a :class:`StepPlan`;
rank 0 returns the logits and the step's counted traffic), finish requests. :class:`LocalRunner`
is the same interface over the single-device ``LlamaModel`` (the reference).

The caller's plans name each request's new tokens, start position and adapter slot, with no KV
pages (``kv_blocks`` = ``()``): as the engine does, every rank reserves each request's pages in a
:class:`KvTable` (in the plan's order, from a pool with the same number of pages as every other
rank's, so the page ids agree), puts them in ``kv_blocks`` and builds the batch with the engine's
:class:`StepBuilder` (a rank's shard widths as its LoRA row shapes).

Processes are bounded: every reply is awaited with a timeout (a hang guard, not a verdict), and
``close`` (also on error and on ``with`` exit) stops, then terminates, then kills every rank.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Self

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.executor.tensor_parallel import lora_shapes
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import AdapterResidency, ResidentAdapter
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.tp.collectives import Collectives, TorchDistributedCollectives
from services.gpu_worker.tp.context import TensorParallelContext
from services.gpu_worker.tp.rank import build_rank_model
from services.gpu_worker.tp.sharding import TensorParallelLayout, shard_adapter
from services.model_files.model_config import ModelConfig
from services.runtime.process.ports import free_port


class SingleProcess(Collectives):
    """N = 1: nothing to exchange (and 0 bytes counted)."""

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def build_rank_pool(
    config: ModelConfig,
    layout: TensorParallelLayout,
    num_pages: int,
    kv_block_tokens: int,
    dtype: torch.dtype,
    device="cpu",
) -> UnifiedPool:
    """The rank's pool: ``num_pages`` (the same on every rank) pages of its ``kv_dim``."""
    pool_layout = PoolLayout(
        num_pages=num_pages,
        kv_block_tokens=kv_block_tokens,
        kv_dim=layout.kv_dim,
        num_layers=config.num_layers,
    )
    return UnifiedPool(PoolView.zeros(pool_layout, dtype, device))


def page_adapter(
    residency: AdapterResidency, adapter: HostAdapter, layout: TensorParallelLayout
) -> ResidentAdapter:
    """Page the rank's shard of ``adapter`` (the full adapter; sharded here, or as is at N = 1)."""
    return residency.load(shard_adapter(adapter, layout) if layout.size > 1 else adapter)


def placement_fingerprint(resident: ResidentAdapter) -> tuple:
    """Pages and row offsets of a resident adapter: equal on every rank of a group."""
    return (
        tuple(resident.pages),
        tuple(
            (key, tuple(m.rows.a_offsets.tolist()), tuple(m.rows.b_offsets.tolist()))
            for key, m in sorted(resident.modules.items())
        ),
    )


@dataclass(frozen=True)
class GroupSpec:
    """What every rank builds (picklable: sent to the spawned ranks)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    """The full base weights (HF names); each rank shards them."""
    size: int
    dtype: torch.dtype = torch.float32
    num_pages: int = 256
    kv_block_tokens: int = 16
    threads: int = 1
    """torch intra-op threads per rank."""


@dataclass
class StepResult:
    logits: torch.Tensor
    """float32 [R, vocab] of rank 0."""
    seconds: float
    """Rank 0's forward time (batch build excluded)."""
    traffic: dict = field(default_factory=dict)
    """Rank 0's collectives during the step: ``TrafficCounter.snapshot()``."""


class _Rank:
    """The state of one rank (in its process, or in the parent for ``LocalRunner``)."""

    def __init__(self, spec: GroupSpec, layout: TensorParallelLayout, collectives):
        self.layout = layout
        self.collectives = collectives
        if layout.size > 1:
            self.model = build_rank_model(
                spec.config, spec.weights, TensorParallelContext(layout, collectives), spec.dtype
            )
        else:
            self.model = LlamaModel(spec.config, spec.weights, spec.dtype)
        self.pool = build_rank_pool(spec.config, layout, spec.num_pages, spec.kv_block_tokens, spec.dtype)
        self.residency = AdapterResidency(self.pool)
        shapes = lora_shapes(layout) if layout.size > 1 else None
        self.builder = StepBuilder(self.model, self.pool, shapes=shapes)
        self.tables: dict[str, KvTable] = {}

    def with_pages(self, plan: StepPlan) -> StepPlan:
        """``plan`` with each request's KV pages reserved (in plan order) and put in ``kv_blocks``."""
        requests = []
        for request in plan.requests:
            if request.kv_blocks or request.borrowed:
                raise ValueError(
                    f"{request.request_id}: the harness reserves the KV pages; pass kv_blocks=()"
                )
            if request.adapter is not None:
                resident = self.residency.get(request.adapter.adapter_id)
                if resident is None or resident.placement != request.adapter.placement:
                    raise ValueError(f"{request.request_id}: adapter {request.adapter} is not resident")
            table = self.tables.get(request.request_id)
            if table is None:
                table = self.tables[request.request_id] = KvTable(self.pool)
            table.reserve(request.end_position)
            requests.append(replace(request, kv_blocks=tuple(tuple(b) for b in table.blocks)))
        return replace(plan, requests=tuple(requests))

    def handle(self, command: str, arg):
        if command == "adapter":
            resident = page_adapter(self.residency, arg, self.layout)
            return placement_fingerprint(resident), tuple(self.residency.ids()), resident.placement
        if command == "step":
            batch = self.builder.build(self.with_pages(arg), self.residency.get)
            self.collectives.traffic.reset()
            start = time.perf_counter()
            logits = self.model.forward(batch, self.pool)
            seconds = time.perf_counter() - start
            return StepResult(logits if self.layout.rank == 0 else torch.empty(0), seconds,
                              self.collectives.traffic.snapshot())  # fmt: skip
        if command == "finish":
            for request_id in arg:
                self.tables.pop(request_id).release()
            return None
        raise ValueError(f"unknown command {command!r}")


def _rank_main(rank: int, spec: GroupSpec, port: int, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec.size,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        layout = TensorParallelLayout.for_config(spec.config, spec.size, rank)
        state = _Rank(spec, layout, TorchDistributedCollectives())
        conn.send(("ok", None))
        while True:
            command, arg = conn.recv()
            if command == "stop":
                break
            conn.send(("ok", state.handle(command, arg)))
    except Exception:  # noqa: BLE001 - reported to the parent, which closes the group
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


class RankGroupError(RuntimeError):
    pass


class RankGroup:
    """``spec.size`` spawned rank processes, driven by the parent. Use as a context manager."""

    def __init__(self, spec: GroupSpec, reply_timeout_s: float = 300.0):
        import torch.multiprocessing as mp

        self.spec = spec
        self.reply_timeout_s = reply_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        try:
            for rank in range(spec.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(rank, spec, port, child), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._replies()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _replies(self) -> list:
        out = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.reply_timeout_s):
                raise RankGroupError(f"rank {rank} did not answer in {self.reply_timeout_s} s")
            try:
                status, value = conn.recv()
            except EOFError as e:
                raise RankGroupError(f"rank {rank} died (exit code {self._procs[rank].exitcode})") from e
            if status != "ok":
                raise RankGroupError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out

    def _all(self, command: str, arg) -> list:
        try:
            for conn in self._conns:
                conn.send((command, arg))
            return self._replies()
        except BaseException:
            self.close()
            raise

    def load_adapter(self, adapter: HostAdapter) -> list[tuple]:
        """Page ``adapter``'s shard on every rank; per rank, its placement fingerprint, the ids
        resident after it (in LRU order: an eviction shows) and its placement (for an
        ``AdapterSlot``)."""
        return self._all("adapter", adapter)

    def step(self, plan: StepPlan) -> StepResult:
        return self._all("step", plan)[0]

    def finish(self, request_ids: list[str]) -> None:
        self._all("finish", list(request_ids))

    def close(self) -> None:
        """Stop every rank: ask, then terminate, then kill; idempotent."""
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


class LocalRunner:
    """The same interface in this process: ``size`` 1 runs the plain single-device model."""

    def __init__(self, spec: GroupSpec):
        if spec.size != 1:
            raise ValueError("LocalRunner runs one rank; use RankGroup for size > 1")
        self._rank = _Rank(spec, TensorParallelLayout.for_config(spec.config, 1, 0), SingleProcess())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def load_adapter(self, adapter: HostAdapter) -> list[tuple]:
        return [self._rank.handle("adapter", adapter)]

    def step(self, plan: StepPlan) -> StepResult:
        return self._rank.handle("step", plan)

    def finish(self, request_ids: list[str]) -> None:
        self._rank.handle("finish", list(request_ids))

    def close(self) -> None:
        pass
