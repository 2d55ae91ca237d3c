"""Applying a DGFM plan (seed 003 §4.5): the order of one cycle's recalls, and the driver that has
the workers make them.

Cancelling a cycle ``u0 -> u1 -> ... -> u0`` by ``m`` blocks moves no occupancy, but each
recall needs ``m`` free slots in its owner's pool before it frees ``m`` at its holder. So the
recalls go round the cycle from a worker that has the room: ``u_k`` recalls from ``u_{k+1}``
into its free slots, which frees the slots ``u_{k+1}`` recalls into, and so on round to
``u_{k-1}``. When no pool on the cycle has ``m`` free blocks (the usual case: DGFM matters when
pools are full), ``u0`` *stages*: it reads its blocks from ``u1`` into host memory and frees them
there, the others recall in turn, and ``u0`` writes its staged blocks into the slots ``u_{n-1}``
freed last.

Each worker's recall is all or none. A cycle that fails midway (a worker gone, a refusal, a
ledger older than the tables) stops there: the recalls made stay made (each is a consistent
move), an open stage is closed (its blocks written back wherever they fit, or recomputed), and
the swap is reported failed with the worker's status. Later swaps of the plan are not attempted:
they were planned from a ledger that no longer holds. No gRPC here: workers are reached through
a :class:`RecallWorkers`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from services.kv_manager.dgfm import CycleSwap, DefragPlan
from services.runtime.errors import DomainError

log = logging.getLogger("loramesh.kv_manager.dgfm")


class StepKind(enum.Enum):
    RECALL = "recall"
    """The owner moves its blocks from the holder into its own free slots."""
    STAGE_OUT = "stage_out"
    """The owner reads its blocks from the holder into host memory and frees them there."""
    STAGE_IN = "stage_in"
    """The owner writes the blocks it staged into its own pool (slots freed meanwhile)."""


@dataclass(frozen=True)
class RecallStep:
    """One call to one worker."""

    kind: StepKind
    owner_id: str
    """The worker whose blocks move (the one called)."""
    holder_id: str
    """The worker that held them."""
    blocks: int


def cycle_steps(swap: CycleSwap, free_blocks: Mapping[str, int]) -> tuple[RecallStep, ...]:
    """The calls that cancel ``swap``, in order, given each worker's free KV blocks.

    Starts at the first worker of the cycle (in cycle order) with ``swap.blocks`` free; if none
    has, ``cycle[0]`` stages (its stage-out first, its stage-in last).
    """
    cycle, m = swap.cycle, swap.blocks
    n = len(cycle)
    recalls = [(cycle[i], cycle[(i + 1) % n]) for i in range(n)]
    start = next((i for i, worker in enumerate(cycle) if free_blocks.get(worker, 0) >= m), None)
    if start is not None:
        ordered = recalls[start:] + recalls[:start]
        return tuple(RecallStep(StepKind.RECALL, owner, holder, m) for owner, holder in ordered)
    (first_owner, first_holder), rest = recalls[0], recalls[1:]
    return (
        RecallStep(StepKind.STAGE_OUT, first_owner, first_holder, m),
        *(RecallStep(StepKind.RECALL, owner, holder, m) for owner, holder in rest),
        RecallStep(StepKind.STAGE_IN, first_owner, first_holder, m),
    )


class RecallWorkers(Protocol):
    """The workers as the driver reaches them (gRPC in the kv_manager, engines in tests).
    Each call raises the worker's domain error, ``Unavailable`` when it cannot be reached."""

    async def recall(self, owner_id: str, holder_id: str, blocks: int) -> int:
        """``owner_id`` recalls ``blocks`` of its blocks from ``holder_id``; blocks moved."""
        ...

    async def stage_out(self, owner_id: str, holder_id: str, blocks: int) -> int:
        """``owner_id`` stages ``blocks`` of its blocks out of ``holder_id``; the stage id."""
        ...

    async def stage_in(self, owner_id: str, stage_id: int) -> int:
        """``owner_id`` writes stage ``stage_id`` back; blocks that came home to its pool."""
        ...


@dataclass(frozen=True)
class SwapOutcome:
    """What became of one planned swap."""

    swap: CycleSwap
    blocks_moved: int
    """Blocks that came home (all ``swap.blocks * len(cycle)`` when it succeeded)."""
    failed_step: RecallStep | None = None
    """The call that failed; None when the swap was done."""
    error: DomainError | None = None
    """Its error, as the worker reported it."""

    @property
    def done(self) -> bool:
        return self.failed_step is None


@dataclass(frozen=True)
class DefragOutcome:
    """What applying a plan did."""

    plan: DefragPlan
    swaps: tuple[SwapOutcome, ...]
    """One per swap attempted, in plan order (the last is the failed one, if any)."""

    @property
    def swaps_done(self) -> int:
        return sum(1 for s in self.swaps if s.done)

    @property
    def blocks_moved(self) -> int:
        return sum(s.blocks_moved for s in self.swaps)

    @property
    def failure(self) -> SwapOutcome | None:
        return next((s for s in self.swaps if not s.done), None)


async def apply_swap(swap: CycleSwap, free_blocks: Mapping[str, int], workers: RecallWorkers) -> SwapOutcome:
    """Have the workers cancel ``swap``; see the module docstring for what a failure leaves."""
    moved, stage_id = 0, None
    for step in cycle_steps(swap, free_blocks):
        try:
            if step.kind is StepKind.STAGE_OUT:
                stage_id = await workers.stage_out(step.owner_id, step.holder_id, step.blocks)
            elif step.kind is StepKind.STAGE_IN:
                moved += await workers.stage_in(step.owner_id, stage_id)
                stage_id = None
            else:
                moved += await workers.recall(step.owner_id, step.holder_id, step.blocks)
        except DomainError as error:
            log.warning(
                "DGFM: %s of %s from %s failed: %s", step.kind.value, step.owner_id, step.holder_id, error
            )
            if stage_id is not None and step.kind is not StepKind.STAGE_IN:
                moved += await _close_stage(workers, swap.cycle[0], stage_id)
            return SwapOutcome(swap, moved, step, error)
    return SwapOutcome(swap, moved)


async def _close_stage(workers: RecallWorkers, owner_id: str, stage_id: int) -> int:
    """Close an open stage after a failure; if even that fails, the owner closes it itself when
    the stage times out (``BlockRecalls.stage_timeout_s``)."""
    try:
        return await workers.stage_in(owner_id, stage_id)
    except DomainError as error:
        log.warning("DGFM: could not close stage %d on %s: %s", stage_id, owner_id, error)
        return 0


async def apply_plan(
    plan: DefragPlan, free_blocks: Mapping[str, int], workers: RecallWorkers
) -> DefragOutcome:
    """Apply ``plan``'s swaps in order, stopping at the first that fails."""
    outcomes: list[SwapOutcome] = []
    for swap in plan.swaps:
        outcome = await apply_swap(swap, free_blocks, workers)
        outcomes.append(outcome)
        if not outcome.done:
            break
    return DefragOutcome(plan, tuple(outcomes))
