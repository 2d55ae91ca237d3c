"""The engine's speculative decoding: which running requests draft this step, how many tokens,
their KV positions reserved, and what was drafted and accepted per adapter. With ``suffix``,
each finished request's output is kept in its adapter and tenant's index
(``adapter_indexes.py``), which later requests of that adapter and tenant draft from too.

A request drafts when it decodes (its prefill is done), keeps all its KV in this pool (not
borrowing), has no grammar (its masks are computed for one row a step), did not opt out
(``no_speculation`` in its sampling params), and its budget allows
(``draft_budget.py``). Drafts take only free KV pages: a guess is never worth evicting an
adapter or a cached prefix, borrowing, or preempting another request; with no room it drafts
nothing this step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from services.gpu_worker.engine.kv_reservation import KvReservation
from services.gpu_worker.engine.policies.batch_policy import StepOutcome
from services.gpu_worker.engine.policies.linear_cost import OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import step_cost_model
from services.gpu_worker.engine.request import EngineRequest, RequestState
from services.gpu_worker.engine.speculation.acceptance import DraftChances
from services.gpu_worker.engine.speculation.adapter_indexes import AdapterIndexes, IndexKey
from services.gpu_worker.engine.speculation.adapter_output_index import AdapterOutputIndex
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.draft_cost import DraftPrices, draft_prices
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter

ADAPTER_DECAY = 0.98
"""Weight an adapter's (and a match length's) earlier verifications keep at each new one: its
rate follows its recent requests."""

MAX_ADAPTER_RATES = 1024
"""Adapters whose acceptance is kept, the least recently verified forgotten first."""

BASE_MODEL = ""
"""The adapter key of requests on the base model in :class:`DraftCounts`."""


@dataclass
class DraftCounts:
    """Drafted and accepted tokens per adapter id since start (``BASE_MODEL``: the base model)."""

    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def add(self, adapter_id: str | None, drafted: int, accepted: int) -> None:
        key = adapter_key(adapter_id)
        self.drafted[key] = self.drafted.get(key, 0) + drafted
        self.accepted[key] = self.accepted.get(key, 0) + accepted


class Speculator:
    """Drafts for the batch before each step; told what each verification accepted after it."""

    def __init__(
        self,
        kv: KvReservation,
        max_positions: int,
        settings: DraftSettings | None = None,
        adapter_known: Callable[[str], bool] | None = None,
        cost: OnlineFit[StepOutcome] | None = None,
        max_prefill_tokens: int | None = None,
    ):
        """``max_positions``: the model's context; no draft reaches past it. ``adapter_known``:
        whether the engine still has an adapter; given, the mode is ``suffix`` (drafts from
        each adapter's recent outputs too, an index dropped with its adapter). ``cost``: the
        step-cost model that prices draft rows (the engine's, fitted online, by default).
        ``max_prefill_tokens``: the step's token budget, which a step's prefill and drafts share."""
        self.kv = kv
        self.max_positions = max_positions
        self.settings = settings = settings or DraftSettings()
        self.cost = cost or step_cost_model()
        self.max_prefill_tokens = max_prefill_tokens
        self.counts = DraftCounts()
        self.chances = DraftChances(
            settings.prior_acceptance, settings.prior_weight, ADAPTER_DECAY, MAX_ADAPTER_RATES
        )
        """Draft acceptance per adapter (``BASE_MODEL``: the base model) and match length."""
        self.adapter_known = adapter_known
        self.indexes = (
            AdapterIndexes(
                settings.max_adapter_indexes, settings.adapter_index_tokens, settings.adapter_max_ngram
            )
            if adapter_known is not None
            else None
        )
        """``suffix``'s per adapter and tenant indexes (None: ``ngram``)."""
        self._unfinished: dict[str, EngineRequest] = {}
        """``suffix``: requests that drafted, their output kept in their index once finished."""

    def draft(self, batch: list[EngineRequest]) -> int:
        """Set each request's drafts for this step (() for those that draft none), their KV
        reserved; returns the draft rows the step adds."""
        if self.indexes is not None:
            self._keep_finished_outputs()
        for request in batch:
            request.drafts = ()
        # The step's decode rows are capped: the decoding requests' own first, then drafts, a
        # row at a time to the draft token likeliest to be accepted (a request's j-th token is
        # accepted with its chance to the j-th power): at batch 8, four requests drafting one
        # token each save more than one request drafting four.
        decoding = sum(1 for request in batch if request.new_tokens == 1)
        room = self.settings.max_step_rows - decoding
        if self.max_prefill_tokens is not None:
            prefill = sum(r.new_tokens for r in batch if r.new_tokens > 1)
            room = min(room, self.max_prefill_tokens - prefill)
        if room <= 0:
            return 0
        adapters = len({r.spec.adapter_id for r in batch} - {None})
        settings = self.settings
        prices = draft_prices(
            self.cost.cost, decoding, adapters, settings.min_row_share, settings.verify_step_share
        )
        proposals = {
            request.request_id: (drafts, self._chance(request))
            for request in batch
            if (drafts := self._drafts(request, room, prices))
        }
        shares = allot_rows(proposals, room)
        rows, saving = 0, 0.0
        for request in batch:
            proposed, chance = proposals.get(request.request_id, ((), 0.0))
            drafts = proposed[: shares.get(request.request_id, 0)]
            if drafts and self.kv.reserve_drafts(request, request.total_len + len(drafts)):
                request.drafts = drafts
                rows += len(drafts)
                saving += prices.saving(chance, len(drafts))
        if rows and saving <= prices.step_s:
            # Together not worth a verifying step: a plain step, but for the requests probing
            # (whose drafts never pay: a probe is what lets them draft again; alone at batch 1
            # it was dropped here, so a request, and its adapter's next ones, never drafted
            # again after a few early misses) and those whose probe for this rule is due (their
            # drafts' pages stay reserved either way).
            rows = 0
            for request in batch:
                drafter = request.drafter
                if request.drafts and drafter is not None and (drafter.probing or drafter.budget.declined()):
                    request.drafts = request.drafts[:1]
                    rows += 1
                else:
                    request.drafts = ()
        return rows

    def observe(self, outcome: StepOutcome) -> None:
        """What a step cost (its draft rows among its decode tokens): the cost model learns."""
        self.cost.observe(outcome)

    def _chance(self, request: EngineRequest) -> float:
        """The chance each position of ``request``'s drafts this step is accepted; 1 for a probe
        (its row is what lets the request draft again)."""
        drafter = request.drafter
        assert drafter is not None
        return 1.0 if drafter.probing else drafter.chance

    def _drafts(self, request: EngineRequest, room: int, prices: DraftPrices) -> tuple[int, ...]:
        if (
            request.new_tokens != 1
            or request.table is not None
            or request.grammar is not None
            or request.spec.sampling.no_speculation
        ):
            return ()
        # The step draws one token after the drafts anyway: neither may pass max_tokens or the context.
        limit = min(
            room,
            request.spec.sampling.max_tokens - len(request.output_ids) - 1,
            self.max_positions - request.total_len - 1,
        )
        if limit <= 0:
            return ()
        if request.drafter is None:
            request.drafter = RequestDrafter(self.settings, self._adapter_index(request))
        chance = partial(self.chances.match, adapter_key(request.spec.adapter_id))
        return request.drafter.propose(request.all_ids, limit, prices, chance)

    def _adapter_index(self, request: EngineRequest) -> AdapterOutputIndex | None:
        if self.indexes is None:
            return None
        self._unfinished[request.request_id] = request
        key = index_key(request)
        index = self.indexes.get(key)
        if index is None:  # made empty now, so this request drafts from outputs finished later
            self.indexes.add(key, [])
            index = self.indexes.get(key)
        return index

    def _keep_finished_outputs(self) -> None:
        """Put the outputs of requests finished since the last step in their indexes; drop the
        indexes of adapters the engine no longer has."""
        assert self.indexes is not None and self.adapter_known is not None
        for request_id, request in list(self._unfinished.items()):
            if request.state is RequestState.FINISHED:
                del self._unfinished[request_id]
                if request.spec.adapter_id is None or self.adapter_known(request.spec.adapter_id):
                    self.indexes.add(index_key(request), request.output_ids)
        self.indexes.drop_unknown(self.adapter_known)

    def verified(self, request: EngineRequest, accepted: int) -> None:
        """``accepted`` of ``request``'s drafts (a prefix) were the tokens drawn; its drafts end."""
        drafted = len(request.drafts)
        request.drafts = ()
        if drafted and request.drafter is not None:
            request.drafter.verified(drafted, accepted)
            self.counts.add(request.spec.adapter_id, drafted, accepted)
            key = adapter_key(request.spec.adapter_id)
            self.chances.verified(key, request.drafter.match_length, drafted, accepted)


def adapter_key(adapter_id: str | None) -> str:
    """An adapter's key in the per-adapter counts (``BASE_MODEL`` for the base model)."""
    return BASE_MODEL if adapter_id is None else adapter_id


def index_key(request: EngineRequest) -> IndexKey:
    """Whose outputs a request may draft from: its adapter's, in its tenant's namespace."""
    return request.spec.adapter_id, request.spec.prefix_cache_namespace


def allot_rows(proposals: dict[str, tuple[tuple[int, ...], float]], room: int) -> dict[str, int]:
    """How many of each request's proposed drafts the step verifies, ``room`` rows in all: by
    request id, its drafts and the chance each position is accepted. A row goes to the draft
    token likeliest to be accepted (the ``j``-th of a request at its chance to the ``j``-th
    power), a probe's first (what lets its request draft again); each request's share is a
    prefix of its drafts."""
    candidates = sorted(
        (-(chance**j), j, order, rid)
        for order, (rid, (drafts, chance)) in enumerate(proposals.items())
        for j in range(1, len(drafts) + 1)
    )
    shares: dict[str, int] = {}
    for _, _, _, rid in candidates[:room]:
        shares[rid] = shares.get(rid, 0) + 1
    return shares
