"""The single-device executor: one model, one pool buffer, plans run as they are.

Today's path of every worker: the step inputs turn a plan into the model's batch (decode steps
from persistent buffers, the rest through the step builder), the model runs it over the pool;
merged mode folds one adapter into the model's own weights.
"""

from __future__ import annotations

import torch

from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv import RManager
from services.gpu_worker.engine.decode_delta import DecodeDelta
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.executor import BorrowedLookup
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.decode_graphs import DecodeGraphs
from services.gpu_worker.executor.pool_buffer import pool_buffer, pool_with_spare_page, spare_key_rows
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.executor.step_inputs import StepInputs
from services.gpu_worker.kernels.dispatch import resolve_backend
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.lora.merged_weights import MergedWeights
from services.gpu_worker.memory.adapter_residency import ResidentAdapter, write_rows
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.step_batch import StepBatch


class LocalExecutor:
    """Runs plans on ``model``'s device over a pool sized by ``config``."""

    supports_lending = True

    def __init__(self, model: LlamaModel, config: EngineConfig):
        self.model = model
        self.supports_merging = model.quantization == "none"
        """Merged mode folds an adapter into fp weights: not into quantized blocks."""
        self.config = model.config
        cfg = model.config
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        layout = PoolLayout(
            num_pages=PoolLayout.pages_for_bytes(
                int(config.pool_mib * 2**20), config.kv_block_tokens, kv_dim, model.dtype
            ),
            kv_block_tokens=config.kv_block_tokens,
            kv_dim=kv_dim,
            num_layers=cfg.num_layers,
        )
        self.graphs: DecodeGraphs | None = None
        """Decode steps' CUDA graphs (``cuda_graphs`` on, on a CUDA device); None: eager."""
        if config.cuda_graphs == "on" and torch.device(model.device).type == "cuda":
            self.view, whole = pool_with_spare_page(layout, model.dtype, model.device)
            self.graphs = DecodeGraphs(model, whole, spare_key_rows(layout, model.device))
        else:
            self.view = pool_buffer(layout, model.dtype, model.device, shared=config.shared_pool)
        if config.deterministic:  # refuse at start what would fail every step
            model.check_batch_invariant()
            resolve_backend(config.lora_backend, self.view.buffer, batch_invariant=True)
        self.builder = StepBuilder(model, self.view)
        self.inputs = StepInputs(self.builder)
        """Each plan's batch: decode steps from persistent buffers, the rest from ``builder``."""
        self.merged = MergedWeights(model)
        """The adapter folded into the base weights in merged mode (dLoRA), if any."""
        self._resident: dict[str, ResidentAdapter] = {}
        """The load in force of each adapter whose rows are in the pool (what plans' slots name)."""
        self._borrowed: BorrowedLookup | None = None

    def prepare_adapter(self, adapter: HostAdapter) -> HostAdapter:
        return adapter

    def load_adapter(self, adapter: HostAdapter, resident: ResidentAdapter) -> None:
        write_rows(self.view.buffer, adapter, resident)
        self._resident[adapter.adapter_id] = resident

    def evict_adapter(self, adapter_id: str) -> None:
        self._resident.pop(adapter_id, None)
        self.builder.forget_adapter(adapter_id)

    def lend_through(self, rm: RManager, tables: BorrowedLookup) -> None:
        self.builder.rm = rm
        self._borrowed = tables

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self._run(self.inputs.build(plan, self._resident.get, self._borrowed))

    def execute_decode(self, delta: DecodeDelta) -> torch.Tensor | None:
        batch = self.inputs.decode(delta, self._resident.get)
        return None if batch is None else self._run(batch)

    def _run(self, batch: StepBatch) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        return self.model.forward(batch, self.view)

    def merge(self, adapter: HostAdapter) -> None:
        self.merged.merge(adapter)

    def unmerge(self) -> None:
        self.merged.unmerge()

    def close(self) -> None:
        """The shared pool's descriptor closed; the buffer and weights go with the object."""
        self.view.close()
