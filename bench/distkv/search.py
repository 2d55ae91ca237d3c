"""The longest context a configuration serves, found by bisection over context lengths.

A probe sends one request of a given context length to an otherwise idle configuration and says
whether it completed. Bisection keeps a bracket ``[served, not served)``: the lower end is probed
first, the upper end is a length nothing can serve (more KV than all pools hold together), so it
is never probed. The first split may be given (a goal length: is it served?) instead of the
midpoint, which settles the question a goal asks with one probe. The search stops when the bracket is ``resolution`` tokens narrow or after
``max_probes`` probes, and reports the bracket it reached.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Probe:
    """One probe's result."""

    context_tokens: int
    """Prompt + generated tokens asked for."""
    served: bool
    """The request completed with every token."""
    detail: str = ""
    """Why not, when it was not (the worker's status, or what the worker was seen doing)."""
    elapsed_s: float = 0.0
    """Wall time of the probe."""


@dataclass
class SearchResult:
    """The bracket the search reached."""

    longest_served: int | None
    """The longest context that completed (None: not even the first probe did)."""
    shortest_refused: int
    """The shortest context known not to complete (probed, or the bound given)."""
    probes: list[Probe] = field(default_factory=list)
    """Every probe, in order."""


async def longest_servable(
    probe: Callable[[int], Awaitable[Probe]],
    low: int,
    unservable: int,
    resolution: int,
    max_probes: int,
    first_split: int | None = None,
) -> SearchResult:
    """Bisect ``[low, unservable)`` with ``probe``: ``low`` first, then ``first_split`` (when it
    lies inside), then the bracket's midpoint in steps of ``resolution`` from its served end."""
    if not 0 < low < unservable:
        raise ValueError(f"need 0 < low < unservable, got low={low}, unservable={unservable}")
    if resolution < 1 or max_probes < 1:
        raise ValueError(f"resolution and max_probes must be >= 1, got {resolution} and {max_probes}")
    result = SearchResult(longest_served=None, shortest_refused=unservable)
    served: int | None = None

    async def split_at(length: int) -> None:
        nonlocal served
        outcome = await probe(length)
        result.probes.append(outcome)
        if outcome.served:
            served = length
        else:
            result.shortest_refused = length

    await split_at(low)
    if served is None:
        return result
    if first_split is not None and low < first_split < unservable and max_probes > 1:
        await split_at(first_split)
    while len(result.probes) < max_probes and result.shortest_refused - served > resolution:
        steps = (result.shortest_refused - served) // resolution
        await split_at(served + max(1, steps // 2) * resolution)
    result.longest_served = served
    return result
