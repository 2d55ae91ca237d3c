"""A plan into the model's :class:`StepBatch`, with as little host work as the step allows.

Plain decode steps (every request one new token, its KV in this pool) come from the
:class:`PersistentBatch`, whose rows, positions and block tables change only where requests
joined, left or grew a block; with the Triton backend their LoRA segments come from the
:class:`LoraTables`, built on the device from each adapter load's slot. A decode step that
continues the last one (the same requests in the same rows, each one token further) is a
:class:`DecodeDelta`: handed over as one by the engine (:meth:`StepInputs.decode`), or found in a
full plan by the :class:`DecodeEncoder` with whole-list passes in C. Every other step (prefill, mixed, drafts
to verify, borrowed KV) goes through the :class:`StepBuilder` as before; the persistent batch
finds its rows again at the next decode step by comparing ids and table objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, itemgetter

from services.gpu_worker.engine.decode_delta import DecodeColumns, DecodeDelta, DecodeEncoder
from services.gpu_worker.engine.executor import BorrowedLookup
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.lora_tables import LoraTables
from services.gpu_worker.executor.persistent_batch import PersistentBatch, is_plain_decode
from services.gpu_worker.executor.step_builder import ResidentLookup, StepBuilder
from services.gpu_worker.kernels.dispatch import StepLora, resolve_backend
from services.gpu_worker.model.step_batch import StepBatch

_ids = attrgetter("request_id")
_starts = attrgetter("start_position")
_tables = attrgetter("kv_blocks")
_adapters = attrgetter("adapter")
_activated = attrgetter("adapter_from")
_tokens = attrgetter("token_ids")
_first = itemgetter(0)


def plan_columns(plan: StepPlan) -> DecodeColumns:
    """A plain decode plan's columns, by whole-list passes in C."""
    requests = plan.requests
    return DecodeColumns(
        list(map(_ids, requests)),
        list(map(_starts, requests)),
        list(map(_tables, requests)),
        list(map(_adapters, requests)),
        any(map(_activated, requests)),
    )


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
        self.encoder = DecodeEncoder()
        """Finds the steady decode steps in full plans (those whose LoRA comes from the tables)."""

    def build(
        self, plan: StepPlan, resident: ResidentLookup, borrowed: BorrowedLookup | None = None
    ) -> StepBatch:
        requests = plan.requests
        if not is_plain_decode(requests):
            self.encoder.forget()
            return self.builder.build(plan, resident, borrowed)
        tokens = list(map(_first, map(_tokens, requests)))
        tables = self.uses_tables(plan)
        if tables:
            columns = plan_columns(plan)
            delta = self.encoder.encode(columns, lambda: tokens, plan.lora_backend, plan.batch_invariant)
            if delta is not None:
                return self._advance(delta, resident)
        else:
            self.encoder.forget()
        self.batch.update(requests)
        if tables:
            # An activated LoRA's token before its invocation start is the base model's.
            slots = [None if r.start_position < r.adapter_from else r.adapter for r in requests]
            self.tables.set_rows(slots, resident)
            lora = self.tables.step_lora()
        else:
            lora = self.builder.lora_segments(requests, resident)
        return self._batch(tokens, lora, plan.lora_backend, plan.batch_invariant)

    def decode(self, delta: DecodeDelta, resident: ResidentLookup) -> StepBatch | None:
        """A steady decode step: the rows of the last decode step this built (through the device
        LoRA tables), each one token further, with ``delta``'s changes; None, nothing changed,
        when the last step this built was not that (its rows are not ``delta.request_ids``).
        Its host work follows the rows named in ``delta``, plus one conversion of the new tokens."""
        if not self.uses_tables(delta):
            self.encoder.forget()
            return None
        if not self.encoder.continued(delta):
            return None
        return self._advance(delta, resident)

    def _advance(self, delta: DecodeDelta, resident: ResidentLookup) -> StepBatch:
        self.batch.advance(delta.grown)
        for row, slot in delta.readapted:
            self.tables.set_row(row, slot, resident)
        return self._batch(
            delta.token_ids, self.tables.step_lora(), delta.lora_backend, delta.batch_invariant
        )

    def _batch(
        self, tokens: Sequence[int], lora: StepLora | None, lora_backend: str, batch_invariant: bool
    ) -> StepBatch:
        token_ids, positions, write_keys, group = self.batch.step_inputs(tokens)
        return StepBatch(
            token_ids=token_ids,
            positions=positions,
            write_key_rows=write_keys,
            write_value_rows=write_keys + self.batch.block,
            decode=group,
            prefills=[],
            logits_rows=group.token_rows,
            lora=lora,
            lora_backend=lora_backend,
            batch_invariant=batch_invariant,
        )

    def uses_tables(self, plan: StepPlan | DecodeDelta) -> bool:
        """Whether ``plan``'s decode LoRA comes from the device tables."""
        if self.device_lora is not None:
            return self.device_lora
        if plan.batch_invariant:
            return False  # batch-invariant MBGMV reads token rows the tables do not keep
        return resolve_backend(plan.lora_backend, self.builder.pool.buffer) == "triton"
