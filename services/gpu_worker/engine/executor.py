"""The interface between the engine, which plans steps, and what runs them on devices.

The engine keeps every decision and all accounting: which requests run, their KV pages (its
``UnifiedPool``'s page allocator), where each adapter's rows go (its ``AdapterResidency``),
merged mode, sampling. An executor owns the model weights and the pool's buffer (a
``PoolView``), and carries the decisions out: it writes adapter rows where the engine placed
them, runs a :class:`StepPlan` and returns logits. ``LocalExecutor`` runs on one device; a
tensor-parallel executor runs the same plan on every rank of its group (both in
``services/gpu_worker/executor/``). This contract names no implementation: the worker is
assembled by ``services/gpu_worker/build.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.distkv import BlockTable, RManager
from services.gpu_worker.engine.decode_delta import DecodeDelta
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import ResidentAdapter
from services.model_files.model_config import ModelConfig

BorrowedLookup = Callable[[str], BlockTable]
"""A borrowed request's rManager block table, by request id."""


class Executor(Protocol):
    """Runs the engine's plans on its devices."""

    config: ModelConfig
    """The full model's config (vocabulary, context length, layers), whatever the sharding."""
    view: PoolView
    """The buffer its pool's pages live in, which the engine's allocator hands out
    (``UnifiedPool``); for a tensor-parallel group rank 0's shard buffer (every rank has the same
    pages)."""
    supports_merging: bool
    """Whether :meth:`merge` works (dLoRA's merged mode); the engine refuses the dlora policy
    without it."""
    supports_lending: bool
    """Whether requests' KV may live in rManager block tables (DistKV-LLM borrowing and
    lending); the engine preempts instead of borrowing without it."""

    def prepare_adapter(self, adapter: HostAdapter) -> HostAdapter:
        """The copy of ``adapter`` the engine places and pages (its rows' widths fix the pages
        it needs): the adapter itself on one device, rank 0's shard in a group."""

    def load_adapter(self, adapter: HostAdapter, resident: ResidentAdapter) -> None:
        """Write ``adapter``'s rows (the :meth:`prepare_adapter` copy) at the offsets the
        engine's residency chose for it (``resident``). Called on the engine's copier thread
        (``adapter_copier.py``), while steps run: no plan names these pages until it returns."""

    def evict_adapter(self, adapter_id: str) -> None:
        """The engine evicted ``adapter_id``: its pages are free for other use."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one step: float32 logits of each request's last new token, and of the token before
        each of its drafts (``PlannedRequest.logits_rows`` rows each, in plan order); every new
        token's KV is written. Raises ``CreditorUnavailable`` when a
        borrowed block's creditor cannot be reached (nothing of the step is kept then)."""

    def execute_decode(self, delta: DecodeDelta) -> torch.Tensor | None:
        """Run a decode step that continues the last step this executor ran (its rows, each one
        token further, with ``delta``'s changes) and return :meth:`execute`'s logits; None,
        nothing run, when it holds no persistent batch of those rows: the engine then sends the
        step's plan."""

    def merge(self, adapter: HostAdapter) -> None:
        """Fold ``adapter`` into the base weights (only when :attr:`supports_merging`)."""

    def unmerge(self) -> None:
        """Restore the base weights exactly (a no-op when nothing is merged)."""

    def close(self) -> None:
        """Release what the executor holds beyond memory (processes, process groups)."""


class LendingExecutor(Executor, Protocol):
    """An executor whose plans may hold borrowed requests (:attr:`Executor.supports_lending`)."""

    def lend_through(self, rm: RManager, tables: BorrowedLookup) -> None:
        """Run borrowed requests' KV through ``rm``, finding each one's block table with
        ``tables`` (request id -> table)."""
