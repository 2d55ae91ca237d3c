"""A step's plan as the followers of a tensor-parallel group receive it: only what changed.

A :class:`StepPlan` holds each request's full KV block table (blocks × layers page ids) and its
sampling parameters. The followers of a tensor-parallel group keep what they were told, so rank 0
sends a request in full once (:class:`PlannedRequest`), then, while it keeps running with the
same adapter slot and sampling, only its new tokens, its start position and the blocks appended
to its table (:class:`ContinuedRequest`). A request that leaves a plan (finished,
preempted, paused by the policy) is forgotten on both sides and sent in full if it runs again, so
the followers' state is bounded by one plan and a changed table (a preempted request's new
pages) is never patched.

:class:`PlanEncoder` (rank 0) and :class:`PlanDecoder` (each follower) hold the two mirrors; the
decoder rebuilds the very :class:`StepPlan` rank 0 runs. (A single device's persistent decode
batch takes a shorter form, ``engine/decode_delta.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.gpu_worker.engine.step_plan import PlannedRequest, StepPlan


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
