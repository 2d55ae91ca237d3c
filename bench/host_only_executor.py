"""A device-free executor: the GPU path's host work for a step, with the kernels left out.

On a GPU the worker's step is host work (turning the engine's :class:`StepPlan` into the model's
inputs: token indices, KV write rows, block tables, LoRA segment tables) followed by kernels. The
host part is what bounded the worker on the one H100 this project had (issue 55), and it runs the
same on a CPU: this executor runs exactly that part, through the production code
(``services/gpu_worker/executor/``), and stops where the model's kernels would start. Adapters
are placed by the real :class:`AdapterResidency` with their rows left unwritten (the kernels that
would read them never run), so 128 adapters cost page ids, not gigabytes.

Its tensors live on the CPU, so the small tensor operations the GPU path hands to the device
(gathers of block tables, masks, the LoRA tables' packing) do their element work here, on the
measuring thread; ``bench/step_host_time.py`` times that work apart and takes it out.
PyTorch's ``meta`` device, which would skip it, runs most elementwise operations through Python
reference decompositions (40-650 us an operation measured, against ~2 us dispatched on the CPU):
it would count work a GPU's host never does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.engine.decode_delta import DecodeDelta
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.executor.step_inputs import StepInputs
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import AdapterResidency, ResidentAdapter
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.step_batch import StepBatch
from services.model_files.model_config import BaseModelSpec, ModelConfig


@dataclass(frozen=True)
class ConfigOnlyModel:
    """What the step builder reads of a model: its dimensions (no weights are loaded)."""

    config: BaseModelSpec


class HostOnlyExecutor:
    """Builds each plan's :class:`StepBatch` as the GPU path does; runs no kernel."""

    def __init__(
        self,
        config: BaseModelSpec,
        pool_pages: int,
        kv_block_tokens: int = 16,
        persistent: bool = True,
    ):
        """``persistent``: decode steps through the persistent batch and the device LoRA tables
        (the GPU path since issue 55); False: every step through the step builder (before)."""
        layout = PoolLayout(
            num_pages=pool_pages,
            kv_block_tokens=kv_block_tokens,
            kv_dim=config.num_kv_heads * config.head_dim,
            num_layers=config.num_layers,
        )
        # On the CPU, torch.zeros maps untouched pages lazily: the pool costs only pages written.
        self.view = PoolView.zeros(layout, torch.bfloat16)
        self.pool = UnifiedPool(self.view)
        self.residency = AdapterResidency(self.pool, write=lambda adapter, resident: None)
        self.builder = StepBuilder(ConfigOnlyModel(config), self.view)
        self.inputs = StepInputs(self.builder, device_lora=True)
        self.persistent = persistent
        self.resident: dict[str, ResidentAdapter] = {}
        """The placed adapters by id, as the executor's step inputs look them up."""

    def place(self, adapter: HostAdapter, adapter_id: str) -> ResidentAdapter:
        """Place ``adapter``'s rows under ``adapter_id`` (as the engine's pager would) and make
        its row offsets, as the copier does before a plan may name it."""
        resident = self.residency.load(replace(adapter, adapter_id=adapter_id))
        resident.materialize()
        self.resident[adapter_id] = resident
        return resident

    def execute(self, plan: StepPlan) -> StepBatch:
        """The step's inputs, as the model would receive them."""
        if not self.persistent:
            return self.builder.build(plan, self.resident.get)
        return self.inputs.build(plan, self.resident.get)

    def execute_decode(self, delta: DecodeDelta) -> StepBatch | None:
        """A steady decode step handed over as what changed (the persistent path only; None
        when its rows are not the last step's)."""
        return self.inputs.decode(delta, self.resident.get)


class HostOnlyEngineExecutor:
    """The engine's :class:`~services.gpu_worker.engine.executor.Executor` over a
    :class:`HostOnlyExecutor`: each step's inputs built as the GPU path builds them, then fixed
    logits (every row's argmax token ``token``) in place of the model's, so an engine runs its
    whole step (policy, KV, plan or delta, sampling, events) with no kernel."""

    supports_merging = False
    supports_lending = False

    def __init__(self, host: HostOnlyExecutor, config: ModelConfig, token: int = 5, deltas: bool = True):
        """``config``: the model config the engine reads (its vocabulary sizes the logits);
        ``deltas``: take steady decode steps as deltas (False: decline them, plans only)."""
        self.host = host
        self.config = config
        self.view = host.view
        self.deltas = deltas
        self._token = token
        self._logits: dict[int, torch.Tensor] = {}

    def _rows(self, n: int) -> torch.Tensor:
        logits = self._logits.get(n)
        if logits is None:
            logits = self._logits[n] = torch.zeros(n, self.config.vocab_size)
            logits[:, self._token] = 1
        return logits

    def prepare_adapter(self, adapter: HostAdapter) -> HostAdapter:
        return adapter

    def load_adapter(self, adapter: HostAdapter, resident: ResidentAdapter) -> None:
        self.host.resident[adapter.adapter_id] = resident

    def evict_adapter(self, adapter_id: str) -> None:
        self.host.resident.pop(adapter_id, None)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.host.execute(plan)
        return self._rows(sum(r.logits_rows for r in plan.requests))

    def execute_decode(self, delta: DecodeDelta) -> torch.Tensor | None:
        if not self.deltas or self.host.execute_decode(delta) is None:
            return None
        return self._rows(len(delta.token_ids))

    def close(self) -> None:
        """Nothing held beyond memory."""
