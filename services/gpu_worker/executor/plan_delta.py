"""A step's plan as the followers of a tensor-parallel group receive it: only what changed.

The engine hands its executor a whole :class:`StepPlan` every step: each request's full KV block
table (blocks × layers page ids) and its sampling parameters. Two receivers keep what they were
told and take only what changed: the followers of a tensor-parallel group (below), and the
single-device executor's persistent decode batch (:class:`DecodeDelta`, at the end). Followers keep what they were told,
so rank 0 sends a request in full once (:class:`PlannedRequest`), then, while it keeps running
with the same adapter slot and sampling, only its new tokens, its start position and the blocks
appended to its table (:class:`ContinuedRequest`). A request that leaves a plan (finished,
preempted, paused by the policy) is forgotten on both sides and sent in full if it runs again, so
the followers' state is bounded by one plan and a changed table (a preempted request's new
pages) is never patched.

:class:`PlanEncoder` (rank 0) and :class:`PlanDecoder` (each follower) hold the two mirrors; the
decoder rebuilds the very :class:`StepPlan` rank 0 runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import compress, count
from operator import attrgetter, is_not, itemgetter, ne

from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan


@dataclass(frozen=True)
class ContinuedRequest:
    """A request the followers already hold, as it continues in this step."""

    handle: int
    """The number rank 0 gave the request when it first sent it in full."""
    token_ids: tuple[int, ...]
    """This step's new tokens."""
    start_position: int
    """Position of ``token_ids[0]``."""
    new_blocks: tuple[tuple[int, ...], ...]
    """KV blocks appended to its table since the last step it ran in (one page id per layer)."""


@dataclass(frozen=True)
class NewRequest:
    """A request sent in full, under the handle later steps name it by."""

    handle: int
    request: PlannedRequest


@dataclass(frozen=True)
class PlanDelta:
    """One step for the followers: each request new or continued, in the plan's order."""

    requests: tuple[NewRequest | ContinuedRequest, ...]
    lora_backend: str
    batch_invariant: bool


def _continues(previous: PlannedRequest, request: PlannedRequest) -> bool:
    """Whether ``request`` extends ``previous``: same slot, sampling, borrowing and drafts, and the table
    it ran with still its prefix."""
    return (
        previous.adapter == request.adapter
        and previous.sampling == request.sampling
        and previous.borrowed == request.borrowed
        and previous.draft_tokens == request.draft_tokens
        and request.kv_blocks[: len(previous.kv_blocks)] == previous.kv_blocks
    )


class PlanEncoder:
    """Rank 0's side: turns each plan into the delta against what the followers hold."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, PlannedRequest]] = {}
        """Request id -> (handle, the request as the followers last ran it)."""
        self._next_handle = 0

    def encode(self, plan: StepPlan) -> PlanDelta:
        sent: dict[str, tuple[int, PlannedRequest]] = {}
        items: list[NewRequest | ContinuedRequest] = []
        for request in plan.requests:
            known = self._sent.get(request.request_id)
            if known is not None and _continues(known[1], request):
                handle, previous = known
                new_blocks = request.kv_blocks[len(previous.kv_blocks) :]
                items.append(ContinuedRequest(handle, request.token_ids, request.start_position, new_blocks))
            else:
                handle, self._next_handle = self._next_handle, self._next_handle + 1
                items.append(NewRequest(handle, request))
            sent[request.request_id] = (handle, request)
        self._sent = sent
        return PlanDelta(tuple(items), plan.lora_backend, plan.batch_invariant)


class PlanDecoder:
    """A follower's side: rebuilds rank 0's plan from each delta."""

    def __init__(self) -> None:
        self._held: dict[int, PlannedRequest] = {}

    def decode(self, delta: PlanDelta) -> StepPlan:
        held: dict[int, PlannedRequest] = {}
        requests = []
        for item in delta.requests:
            if isinstance(item, NewRequest):
                request = item.request
            else:
                previous = self._held[item.handle]
                request = replace(
                    previous,
                    token_ids=item.token_ids,
                    start_position=item.start_position,
                    kv_blocks=previous.kv_blocks + item.new_blocks,
                )
            held[item.handle] = request
            requests.append(request)
        self._held = held
        return StepPlan(tuple(requests), delta.lora_backend, delta.batch_invariant)


_ids = attrgetter("request_id")
_starts = attrgetter("start_position")
_tables = attrgetter("kv_blocks")
_adapters = attrgetter("adapter")
_activated = attrgetter("adapter_from")
_tokens = attrgetter("token_ids")
_first = itemgetter(0)
_next = (1).__add__


@dataclass(frozen=True)
class DecodeDelta:
    """A plain decode step of the very requests of the executor's last decode step, in the same
    rows, each one token further (a :class:`ContinuedRequest` per row, named by its row): what
    changed is listed, the steady rows are not named at all. Requests joining or leaving, a row
    whose position does not follow on, anything but one new token per row: a full plan."""

    token_ids: Sequence[int]
    """Each row's new token, in row order (the tokens sampled from the last step's logits)."""
    grown: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    """``(row, kv_blocks)`` of each row whose table changed: its whole new table (blocks
    appended to the one it had are written alone; any other change rewrites the row)."""
    readapted: tuple[tuple[int, AdapterSlot | None], ...] = ()
    """``(row, adapter)`` of each row whose adapter slot changed."""
    lora_backend: str = "auto"
    batch_invariant: bool = False


class DecodeEncoder:
    """Turns full plain-decode plans into :class:`DecodeDelta`s for the persistent batch, with
    whole-list operations that run in C (``map``, list equality, which takes the same object as
    equal without calling its ``__eq__``): no Python bytecode per request on a steady step.

    The engine's tables (``KvCache.frozen_blocks``) and adapter slots are the same objects until
    they change, so only the rows that did are looked at one by one."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        """The last plan's request ids (empty: no plan to continue)."""
        self._next_starts: list[int] = []
        self._tables: list = []
        self._adapters: list = []

    def forget(self) -> None:
        """The last step was not a decode step of the persistent batch: the next is a full plan."""
        self.ids = []

    def encode(self, plan: StepPlan) -> DecodeDelta | None:
        """``plan`` (a plain decode plan) as a delta on the last one; None when it is not one
        (rows joined, left or moved, a position jumped, an activated LoRA's row)."""
        requests = plan.requests
        ids = list(map(_ids, requests))
        starts = list(map(_starts, requests))
        tables = list(map(_tables, requests))
        adapters = list(map(_adapters, requests))
        follows = ids == self.ids and starts == self._next_starts and not any(map(_activated, requests))
        held_tables, held_adapters = self._tables, self._adapters
        self.ids, self._tables, self._adapters = ids, tables, adapters
        self._next_starts = list(map(_next, starts))
        if not follows:
            return None
        grown = ()
        if tables != held_tables:  # C: the same objects compare equal at once
            rows = compress(count(), map(is_not, tables, held_tables))
            grown = tuple((row, tables[row]) for row in rows)
        readapted = ()
        if adapters != held_adapters:
            rows = compress(count(), map(ne, adapters, held_adapters))
            readapted = tuple((row, adapters[row]) for row in rows)
        return DecodeDelta(
            list(map(_first, map(_tokens, requests))),
            grown,
            readapted,
            plan.lora_backend,
            plan.batch_invariant,
        )
