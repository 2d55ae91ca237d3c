"""The engine's side of :class:`~services.gpu_worker.engine.decode_delta.DecodeDelta`: a decode
step that only continues the last one goes to the executor as what changed, not as a plan.

Building a :class:`~services.gpu_worker.engine.step_plan.PlannedRequest` per request per step,
and the executor comparing each with the last, is host work that grows with the batch on every
step. A step whose requests are the last plain decode step's, in the same rows, each one
position further, is found here with whole-list passes over the requests' attributes (C's
``map``/``attrgetter``), and handed over as the new tokens plus the rows whose block table or
adapter slot changed. An executor that holds no persistent batch for these rows (another LoRA
backend, a tensor-parallel group, a step it did not build) declines it; the engine then sends
the plan, and does not offer deltas again under that LoRA backend.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter, methodcaller

import torch

from services.gpu_worker.engine.decode_delta import DecodeColumns, DecodeEncoder
from services.gpu_worker.engine.executor import Executor
from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.engine.step_plan import AdapterSlot

_ids = attrgetter("request_id")
_computed = attrgetter("num_computed")
_kv = attrgetter("kv")
_frozen = methodcaller("frozen_blocks")
_activated = attrgetter("adapter_from")
_outputs = attrgetter("output_ids")
_last = itemgetter(-1)


class SteadyDecode:
    """Offers the executor each step that continues the last plain decode step as a delta."""

    def __init__(self) -> None:
        self.encoder = DecodeEncoder()
        self._declined: str | None = None
        """The LoRA backend under which the executor declined a delta (not offered again)."""
        self.deltas = 0
        """Steps run as deltas since start."""

    def run(
        self,
        executor: Executor,
        batch: list[EngineRequest],
        slots: list[AdapterSlot | None],
        lora_backend: str,
        batch_invariant: bool,
    ) -> torch.Tensor | None:
        """A plain decode step's logits (each request one new token, none borrowed, no drafts)
        when it ran as a delta; None when it must go as a plan (its columns are then the last
        step's all the same)."""
        if lora_backend == self._declined:
            self.encoder.forget()
            return None
        columns = DecodeColumns(
            list(map(_ids, batch)),
            list(map(_computed, batch)),
            list(map(_frozen, map(_kv, batch))),
            slots,
            any(map(_activated, batch)),
        )
        delta = self.encoder.encode(
            columns, lambda: list(map(_last, map(_outputs, batch))), lora_backend, batch_invariant
        )
        if delta is None:
            return None
        logits = executor.execute_decode(delta)
        if logits is None:
            self._declined = lora_backend
            self.encoder.forget()
            return None
        self.deltas += 1
        return logits

    def forget(self) -> None:
        """The step is not a plain decode step: the next cannot continue it."""
        self.encoder.forget()
