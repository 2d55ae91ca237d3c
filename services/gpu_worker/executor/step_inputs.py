"""A plan into the model's :class:`StepBatch`, with as little host work as the step allows.

Plain decode steps (every request one new token, its KV in this pool) come from the
:class:`PersistentBatch`, whose rows and block tables change only where requests joined, left or
grew a block; with the Triton backend their LoRA segments come from the :class:`LoraTables`,
built on the device from each adapter load's slot. Every other step (prefill, mixed, drafts to
verify, borrowed KV) goes through the :class:`StepBuilder` as before; the persistent batch finds
its rows again at the next decode step by comparing ids and table objects.
"""

from __future__ import annotations

from services.gpu_worker.engine.executor import BorrowedLookup
from services.gpu_worker.engine.step_plan import PlannedRequest, StepPlan
from services.gpu_worker.executor.lora_tables import LoraTables
from services.gpu_worker.executor.persistent_batch import PersistentBatch, is_plain_decode
from services.gpu_worker.executor.step_builder import ResidentLookup, StepBuilder
from services.gpu_worker.kernels.dispatch import StepLora, resolve_backend
from services.gpu_worker.model.step_batch import StepBatch


class StepInputs:
    """Builds each step's batch: persistent for plain decode steps, from scratch otherwise."""

    def __init__(self, builder: StepBuilder, device_lora: bool | None = None):
        """``device_lora``: take decode steps' LoRA from the device tables (True) or the step
        builder's host segments (False); None: the tables where the backend resolves to Triton
        (the only one that reads them), the host segments elsewhere."""
        self.builder = builder
        pool = builder.pool
        self.batch = PersistentBatch(pool.layout, pool.device)
        self.tables = LoraTables(builder.shapes, pool.layout.num_layers, pool.device)
        self.device_lora = device_lora

    def build(
        self, plan: StepPlan, resident: ResidentLookup, borrowed: BorrowedLookup | None = None
    ) -> StepBatch:
        requests = plan.requests
        if not is_plain_decode(requests):
            return self.builder.build(plan, resident, borrowed)
        self.batch.update(requests)
        token_ids, positions, write_keys, group = self.batch.step_inputs(requests)
        return StepBatch(
            token_ids=token_ids,
            positions=positions,
            write_key_rows=write_keys,
            write_value_rows=write_keys + self.batch.block,
            decode=group,
            prefills=[],
            logits_rows=group.token_rows,
            lora=self._lora(plan, requests, resident),
            lora_backend=plan.lora_backend,
            batch_invariant=plan.batch_invariant,
        )

    def uses_tables(self, plan: StepPlan) -> bool:
        """Whether ``plan``'s decode LoRA comes from the device tables."""
        if self.device_lora is not None:
            return self.device_lora
        if plan.batch_invariant:
            return False  # batch-invariant MBGMV reads token rows the tables do not keep
        return resolve_backend(plan.lora_backend, self.builder.pool.buffer) == "triton"

    def _lora(
        self, plan: StepPlan, requests: tuple[PlannedRequest, ...], resident: ResidentLookup
    ) -> StepLora | None:
        if not self.uses_tables(plan):
            return self.builder.lora_segments(requests, resident)
        # An activated LoRA's token before its invocation start is the base model's.
        slots = [None if r.start_position < r.adapter_from else r.adapter for r in requests]
        self.tables.set_rows(slots, resident)
        return self.tables.step_lora()
