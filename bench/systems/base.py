"""What every benchmarked serving system receives and returns.

A system is handed a :class:`RunContext` (the trace, the adapters on disk, the prompts, the
measurement window, the clock) and replays the trace against that clock: request ``r`` is submitted at
``start + r.time_s``; at ``start + window_s`` whatever has not finished is cancelled. It returns
one :class:`RequestRecord` per trace request. Setup (loading the model, registering adapters) is
done before the clock starts and is not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from bench.systems.clock import Clock, WallClock
from bench.workload import TraceRequest

PROMPT_TOKEN_RANGE = (100, 30000)
"""Prompt token ids are drawn from this range of the vocabulary (ordinary word pieces)."""


@dataclass
class RequestRecord:
    """What happened to one trace request; times are seconds since the run's clock started."""

    request_id: str
    adapter: int
    """Adapter index of the trace (0 = most popular)."""
    arrival_s: float
    """When the trace says it arrives (its submission time)."""
    input_len: int
    output_len: int
    """Tokens asked for; a completed request produced exactly these."""
    first_token_s: float | None = None
    """When its first output token was produced; None if never."""
    finish_s: float | None = None
    """When its last token was produced; None if it did not complete within the window."""
    output_tokens: int = 0
    """Tokens produced (up to ``output_len``), counted even when it did not complete."""
    error: str = ""

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and not self.error


@dataclass(frozen=True)
class AdapterSet:
    """The benchmark's adapters: PEFT directories on disk, one per adapter index."""

    root: Path
    """Directory holding one PEFT adapter directory per adapter, named by :meth:`name`."""
    ranks: tuple[int, ...]
    """Rank of adapter ``i`` is ``ranks[i]``."""

    @property
    def count(self) -> int:
        return len(self.ranks)

    @staticmethod
    def name(index: int) -> str:
        return f"bench-{index:05d}"

    def directory(self, index: int) -> Path:
        return self.root / self.name(index)


@dataclass
class RunContext:
    """Everything a system needs for one run."""

    trace: list[TraceRequest]
    """The requests, sorted by arrival time."""
    adapters: AdapterSet
    window_s: float
    """Measurement window: requests still running at ``window_s`` are cancelled and count as not
    completed. Longer than the trace so a system that keeps up can finish its last requests.
    ``math.inf``: no window, every request runs to its end (tests that check outputs)."""
    model_path: str | None = None
    """Base model (GGUF file or HF directory); None: the default SmolLM2-135M-Instruct."""
    max_batch: int = 32
    """Most requests a system runs together (the same limit for every system)."""
    pool_mib: float = 256
    """Device memory for KV cache and adapter weights (the engine's unified pool)."""
    host_cache_mib: float = 64
    """Host RAM budget for adapters; adapters beyond it are read from disk when needed."""
    seed: int = 0
    on_progress: Callable[[int], None] = field(default=lambda done: None)
    """Called with the number of requests that just ended (completed or not)."""
    on_sample: Callable[[float, dict], None] | None = None
    """Receives ``(time_s, engine stats)`` about every 0.25 s from systems that have a pool."""
    clock: Clock = field(default_factory=WallClock)
    """Time source of the synchronous replays (PEFT, merged-swap): the wall clock, or a
    :class:`~bench.systems.clock.TickClock` in tests so what happens at the window does not
    depend on the machine's speed. The asyncio systems run on the event loop's clock."""

    def prompt(self, request: TraceRequest) -> tuple[int, ...]:
        """The request's prompt token ids: deterministic from the seed and the request id."""
        digest = sum(ord(c) * 31**i for i, c in enumerate(request.request_id)) % 2**32
        rng = np.random.default_rng([self.seed, digest])
        low, high = PROMPT_TOKEN_RANGE
        return tuple(int(t) for t in rng.integers(low, high, size=request.input_len))


class ServingSystem(Protocol):
    """One system under test."""

    name: str
    """Short label used in tables and plots."""

    def run(self, context: RunContext) -> list[RequestRecord]:
        """Set up, replay ``context.trace`` against the wall clock, tear down; one record per
        request, in trace order."""
        ...
