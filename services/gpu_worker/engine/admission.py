"""The admission rules: which queued requests start this step, as one pure function.

The engine (``Engine``'s admission) and the cluster simulator (``bench/cluster_sim/worker.py``)
both admit through :func:`admit`, so the simulator's latency model cannot drift from the engine's
rules. Plain values and callables only: no torch, no engine state.

The rules (S-LoRA's and vLLM's continuous batching):
- candidates are tried in queue order (the batch policy's for the engine, FIFO for the simulator);
- at most ``max_running`` requests run together;
- a step prefills at most ``max_prefill_tokens`` context tokens, except that one longer context
  may start alone (else it could never start);
- the first request that cannot start stops admission: a later one never overtakes it (no
  starvation of long requests by short ones);
- except a request whose adapter finds no room in the pool (every resident adapter is held by
  running requests): it keeps its place, and later candidates that need no adapter page-in may
  still start; the caller lets no other adapter be paged in ahead of it (no starvation of new
  adapters by resident ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from typing import TypeVar

T = TypeVar("T")


class Start(Enum):
    """What trying to start one candidate did."""

    STARTED = "started"
    """It runs from this step: its context comes off the prefill budget."""
    SKIPPED = "skipped"
    """It does not run now but does not hold back later candidates (e.g. it ended, or its adapter
    is not the one merged into the base weights)."""
    BLOCKED = "blocked"
    """It does not fit now (its KV): admission stops here."""
    NO_ADAPTER_ROOM = "no_adapter_room"
    """Its adapter cannot be paged in now (every resident adapter is held): it keeps its place,
    and later candidates are still tried (the caller starts none that would page in another
    adapter ahead of it)."""


def fits_prefill_budget(context_tokens: int, budget: int, max_prefill_tokens: int) -> bool:
    """Whether a context of ``context_tokens`` may still be prefilled this step, ``budget`` of
    ``max_prefill_tokens`` being left: it fits, or it is the step's first (it starts alone)."""
    return context_tokens <= budget or budget >= max_prefill_tokens


def admit(
    candidates: Iterable[T],
    *,
    running: Callable[[], int],
    max_running: int,
    max_prefill_tokens: int,
    context_tokens: Callable[[T], int],
    start: Callable[[T], Start],
    skip: Callable[[T], bool] = lambda _: False,
) -> list[T]:
    """Start ``candidates`` in order while the rules allow; the ones started, in order.

    ``running``: requests running now (read before each candidate: starting one, or what starting
    one freed, changes it); ``context_tokens``: what a candidate's prefill computes; ``skip``: a
    candidate passed over before any budget is checked (not queued any more, not runnable in the
    current mode); ``start``: tries to start one (pages its adapter in, reserves its KV).
    """
    admitted: list[T] = []
    budget = max_prefill_tokens
    for candidate in candidates:
        if running() >= max_running:
            break
        if skip(candidate):
            continue
        tokens = context_tokens(candidate)
        if not fits_prefill_budget(tokens, budget, max_prefill_tokens):
            break
        outcome = start(candidate)
        if outcome is Start.BLOCKED:
            break
        if outcome is Start.STARTED:
            admitted.append(candidate)
            budget -= tokens
    return admitted
