"""Which running request gives its KV back when the pool runs dry (the preemption victim).

The victim's pages are freed and it goes back to the front of the queue, to be recomputed from
prompt + output so far when it starts again. A policy sees the running batch as read-only
:class:`RunningRequest` views in the order the requests started, and names one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from services.gpu_worker.engine.policies.batch_policy import RunningRequest
from services.runtime.choices import choose


class PreemptionPolicy(Protocol):
    """Chooses the request to preempt."""

    name: str

    def victim(self, running: Sequence[RunningRequest]) -> RunningRequest:
        """One of ``running`` (never empty; oldest start first) to preempt."""


class Newest:
    """The request that started last (vLLM's and S-LoRA's choice): the oldest keep their place."""

    name = "newest"

    def victim(self, running: Sequence[RunningRequest]) -> RunningRequest:
        return running[-1]


class FewestComputed:
    """The request with the shortest context: its recompute (prefill of prompt + output so far)
    is the cheapest; the newest among equals, so ties keep today's order."""

    name = "fewest_computed"

    def victim(self, running: Sequence[RunningRequest]) -> RunningRequest:
        return min(reversed(running), key=lambda r: r.context_tokens)


PREEMPTION_POLICIES: dict[str, Callable[[], PreemptionPolicy]] = {
    cls.name: cls for cls in (Newest, FewestComputed)
}
"""``--preemption-policy`` name -> policy class."""


def make_preemption_policy(name: str) -> PreemptionPolicy:
    """A preemption policy by name; ValueError naming the known ones otherwise."""
    return choose(PREEMPTION_POLICIES, name, "preemption policy")()
