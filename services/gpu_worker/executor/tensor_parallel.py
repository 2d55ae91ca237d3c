"""The tensor-parallel executor: rank 0 (the driver) of a group runs the engine's plans with its
followers.

Rank 0 holds its shard model and its shard pool buffer — the one the engine's allocator hands
pages of; every rank's pool has the same number of pages, so page ids and adapter row offsets chosen on
rank 0 are valid on every rank. Each operation is first broadcast to the followers
(``torch.distributed.broadcast_object_list`` from rank 0: plans hold no tensors), then run
locally; a step's collectives make every rank compute the same logits, of which rank 0's are
returned. Adapters: the engine places rank 0's shard (:meth:`prepare_adapter`); the *full*
adapter is sent once per load with that placement, and every follower shards it itself
(:func:`shard_adapter`, equal shapes on every rank) and writes its rows at the same offsets.

Followers (:mod:`services.gpu_worker.executor.follower`) run the same :class:`StepBuilder` over the
same :class:`StepPlan`, which they rebuild from what changed since the last step
(``plan_delta.py``: a request's data once, then its new tokens and blocks). Merged mode (dLoRA) and KV lending/borrowing are not supported: the
engine falls back (``EngineStats.fallbacks``).
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.engine.decode_delta import DecodeDelta
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.plan_delta import PlanDecoder, PlanDelta, PlanEncoder
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.kernels.lora_segments import AdapterRows
from services.gpu_worker.lora.host_adapter import HostAdapter, ModuleKey
from services.gpu_worker.memory.adapter_residency import PlacedModule, ResidentAdapter, write_rows
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.tp.collectives import TorchDistributedCollectives
from services.gpu_worker.tp.context import TensorParallelContext
from services.gpu_worker.tp.rank import build_rank_model
from services.gpu_worker.tp.sharding import TensorParallelLayout, shard_adapter
from services.model_files.model_config import ModelConfig
from services.model_files.peft_format import LORA_TARGETS


@dataclass(frozen=True)
class Placement:
    """Where the engine placed an adapter's shard on rank 0, as plain host data (valid on every
    rank: same pages, same shard shapes)."""

    adapter_id: str
    pages: tuple[int, ...]
    nbytes: int
    placement: int
    modules: tuple[tuple[ModuleKey, tuple[int, ...], tuple[int, ...], float], ...]
    """Per module: (key, A row offsets, Bᵀ row offsets, scale)."""

    @classmethod
    def of(cls, resident: ResidentAdapter) -> Placement:
        return cls(
            resident.adapter_id, tuple(resident.pages), resident.nbytes, resident.placement,
            tuple((key, m.a_offsets, m.b_offsets, m.scale) for key, m in resident.modules.items()),
        )  # fmt: skip

    def resident(self, device) -> ResidentAdapter:
        """The :class:`ResidentAdapter` a rank's step builder looks the adapter up by."""
        modules = {}
        for key, a, b, scale in self.modules:
            rows = AdapterRows(
                a_offsets=torch.tensor(a, dtype=torch.int64, device=device),
                b_offsets=torch.tensor(b, dtype=torch.int64, device=device),
            )
            modules[key] = PlacedModule(rows=rows, scale=scale, a_offsets=a, b_offsets=b)
        return ResidentAdapter(self.adapter_id, list(self.pages), modules, self.nbytes, self.placement)


@dataclass(frozen=True)
class LoadOp:
    adapter: HostAdapter
    """The full adapter: each follower shards it."""
    placement: Placement


@dataclass(frozen=True)
class EvictOp:
    adapter_id: str


@dataclass(frozen=True)
class StepOp:
    delta: PlanDelta
    """The step's plan as what changed since the last one (``plan_delta.py``)."""


@dataclass(frozen=True)
class StopOp:
    pass


class OpChannel:
    """Rank 0's operations to its followers, in order, over the default process group. Each is
    pickled once here, so what it costs each follower is counted (:attr:`bytes_sent`)."""

    def __init__(self, device: torch.device | None = None):
        import torch.distributed as dist

        self._dist = dist
        self._device = device if device is not None and device.type == "cuda" else None
        self.bytes_sent = 0
        """Pickled bytes of every operation sent so far (each follower receives them all)."""

    def send(self, op) -> None:
        payload = pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(payload)
        self._dist.broadcast_object_list([payload], src=0, device=self._device)

    def recv(self):
        box = [None]
        self._dist.broadcast_object_list(box, src=0, device=self._device)
        return pickle.loads(box[0])


def pool_pages(config: ModelConfig, layout: TensorParallelLayout, engine_config: EngineConfig, dtype) -> int:
    """Pages of every rank's pool: ``pool_mib`` of the rank's ``kv_dim`` pages (the same on all)."""
    return PoolLayout.pages_for_bytes(
        int(engine_config.pool_mib * 2**20), engine_config.kv_block_tokens, layout.kv_dim, dtype
    )


def lora_shapes(layout: TensorParallelLayout) -> dict[str, tuple[int, int]]:
    """``(in, out)`` widths of each projection's shard rows in a rank's pool."""
    return {m: layout.shard_widths(m) for m in LORA_TARGETS}


class RankState:
    """What every rank of a group holds and does, rank 0 and followers alike: its shard model, its
    pool, the resident adapters' placements, and the step builder that turns plans into batches."""

    def __init__(self, model: LlamaModel, view: PoolView, layout: TensorParallelLayout):
        self.model, self.view, self.layout = model, view, layout
        self.builder = StepBuilder(model, view, shapes=lora_shapes(layout))
        self.resident: dict[str, ResidentAdapter] = {}
        self.plans = PlanDecoder()
        """A follower's mirror of the requests rank 0 sent (rank 0 runs its plans as they are)."""

    def load(self, shard: HostAdapter, resident: ResidentAdapter) -> None:
        write_rows(self.view.buffer, shard, resident)
        self.resident[shard.adapter_id] = resident

    def evict(self, adapter_id: str) -> None:
        self.resident.pop(adapter_id, None)
        self.builder.forget_adapter(adapter_id)

    def step(self, plan: StepPlan) -> torch.Tensor:
        return self.model.forward(self.builder.build(plan, self.resident.get), self.view)

    def handle(self, op) -> bool:
        """Run a follower's operation; False on stop."""
        if isinstance(op, StepOp):
            self.step(self.plans.decode(op.delta))
        elif isinstance(op, LoadOp):
            self.load(shard_adapter(op.adapter, self.layout), op.placement.resident(self.view.device))
        elif isinstance(op, EvictOp):
            self.evict(op.adapter_id)
        elif isinstance(op, StopOp):
            return False
        else:
            raise TypeError(f"unknown tensor-parallel operation {op!r}")
        return True


def build_rank_state(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    layout: TensorParallelLayout,
    num_pages: int,
    kv_block_tokens: int,
    dtype: torch.dtype,
    device,
) -> RankState:
    """A rank of the default process group (initialized): its shard model and pool."""
    ctx = TensorParallelContext(layout, TorchDistributedCollectives())
    model = build_rank_model(config, weights, ctx, dtype, device)
    pool_layout = PoolLayout(
        num_pages=num_pages,
        kv_block_tokens=kv_block_tokens,
        kv_dim=layout.kv_dim,
        num_layers=config.num_layers,
    )
    return RankState(model, PoolView.zeros(pool_layout, dtype, device), layout)


class TensorParallelExecutor:
    """The :class:`~services.gpu_worker.engine.executor.Executor` of rank 0 of a group whose
    default process group is initialized (``tp.group`` starts it and its followers)."""

    supports_merging = False
    supports_lending = False

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        engine_config: EngineConfig,
        size: int,
        dtype: torch.dtype,
        device,
        group=None,
    ):
        """``group``: the followers' lifecycle (``tp.group.TensorParallelGroup``), told by
        :meth:`close` before the followers are asked to stop (``stopping``) and after (``join``)."""
        if engine_config.deterministic:
            raise ValueError("deterministic (batch-invariant) serving is not supported with --tp > 1")
        self.config = config
        self.layout = TensorParallelLayout.for_config(config, size, 0)
        device = torch.device(device)
        num_pages = pool_pages(config, self.layout, engine_config, dtype)
        self.rank = build_rank_state(
            config, weights, self.layout, num_pages, engine_config.kv_block_tokens, dtype, device
        )
        self.model, self.view = self.rank.model, self.rank.view
        self.channel = OpChannel(device)
        self._plans = PlanEncoder()
        self._lock = threading.Lock()
        """Keeps each broadcast and its local run together, in one order on every rank."""
        self._prepared: dict[str, tuple[HostAdapter, HostAdapter]] = {}
        """Adapter id -> (full adapter, rank 0's shard) of the last :meth:`prepare_adapter`."""
        self.group = group
        self._closed = False

    def prepare_adapter(self, adapter: HostAdapter) -> HostAdapter:
        cached = self._prepared.get(adapter.adapter_id)
        if cached is None or cached[0] is not adapter:
            cached = (adapter, shard_adapter(adapter, self.layout))
            self._prepared[adapter.adapter_id] = cached
        return cached[1]

    def load_adapter(self, adapter: HostAdapter, resident: ResidentAdapter) -> None:
        full, shard = self._prepared[adapter.adapter_id]
        if shard is not adapter:
            raise ValueError(f"adapter {adapter.adapter_id}: load_adapter takes prepare_adapter's shard")
        with self._lock:
            self.channel.send(LoadOp(full, Placement.of(resident)))
            self.rank.load(shard, resident)

    def evict_adapter(self, adapter_id: str) -> None:
        with self._lock:
            self.channel.send(EvictOp(adapter_id))
            self.rank.evict(adapter_id)
        self._prepared.pop(adapter_id, None)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        with self._lock:
            try:
                self.channel.send(StepOp(self._plans.encode(plan)))
                return self.rank.step(plan)
            except RuntimeError as error:  # a collective failed: a peer rank is gone
                if self.group is not None and not self._closed:
                    self.group.failed(error)  # by default takes the worker down (no request fails)
                raise

    def execute_decode(self, delta: DecodeDelta) -> None:
        """Declined: the followers take plans (as :class:`PlanDelta`, their own short form)."""

    def merge(self, adapter: HostAdapter) -> None:
        raise NotImplementedError(
            "a tensor-parallel group does not merge adapters (dLoRA falls back to fcfs)"
        )

    def unmerge(self) -> None:
        """Nothing is ever merged."""

    def close(self) -> None:
        """Tell the followers to stop, then let the group reap them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.group is not None:
            self.group.stopping()  # the followers' exits are no longer deaths
        try:
            with self._lock:
                self.channel.send(StopOp())
        finally:
            if self.group is not None:
                self.group.join()
