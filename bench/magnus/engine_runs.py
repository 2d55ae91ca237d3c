"""Running static batches and continuous traces on the real engine (SmolLM2-135M, in-process).

A static batch is run as Magnus' static batching computes it: every row decodes G(B) tokens
(``ignore_eos``: a finished row keeps its slot and its compute until the longest one ends) and
all of them return when the batch ends. A continuous trace is submitted request by request at
its arrival time, each generating exactly its real length; the engine's batch policy orders its
queue (FCFS, or HRRN over the predicted lengths the requests carry).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.magnus.static_batching import StaticBatch, StaticRequest, StaticScheduler, overflow_step, split
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.batch_policy import BatchPolicy
from services.gpu_worker.engine.request import GenerationRequest, TokenEvent
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel
from services.runtime.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    request_id: str
    arrival_s: float
    finish_s: float


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Δ: K and V of every layer for one token, in fp32."""
    config = loaded.config
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


class EngineRunner:
    """One engine on its thread; runs static batches or a continuous trace."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, batch_policy: BatchPolicy | None = None):
        self.engine = local_engine(
            LlamaModel(loaded.config, loaded.weights, torch.float32),
            config,
            eos_token_ids=loaded.config.eos_token_ids,
            batch_policy=batch_policy,
        )
        self._next_id = 0
        self.engine.start()

    def close(self) -> None:
        self.engine.stop()

    def submit(
        self, request: StaticRequest, max_tokens: int, on_finish: Callable[[], None], predicted: bool = False
    ) -> None:
        self._next_id += 1
        self.engine.submit(
            GenerationRequest(
                f"{request.request_id}-{self._next_id}",
                request.prompt_ids,
                SamplingParams(max_tokens=max(1, max_tokens), ignore_eos=True),
                predicted_output_tokens=request.predicted_tokens if predicted else None,
            ),
            _on_end(on_finish),
        )

    def run_batch(self, batch: StaticBatch, steps: int) -> float:
        """Seconds the batch takes with every row decoding ``steps`` tokens."""
        ended = threading.Semaphore(0)
        started = time.monotonic()
        for request in batch.requests:
            self.submit(request, steps, ended.release)
        for _ in batch.requests:
            ended.acquire()
        return time.monotonic() - started


def _on_end(on_finish: Callable[[], None]) -> Callable[[TokenEvent], None]:
    def on_event(event: TokenEvent) -> None:  # engine thread
        if event.finish_reason is not None:
            on_finish()

    return on_event


@dataclass
class StaticRunStats:
    batches: int = 0
    overflows: int = 0
    batch_sizes: list[int] | None = None


def replay_static(
    runner: EngineRunner, scheduler: StaticScheduler, trace: list[StaticRequest], memory_limit: int
) -> tuple[list[Completion], StaticRunStats]:
    """Arrivals in real time; the idle instance runs the scheduler's next batch to its end."""
    pending = sorted(trace, key=lambda r: r.arrival_s)
    completions: list[Completion] = []
    stats = StaticRunStats(batch_sizes=[])
    start = time.monotonic()
    while len(completions) < len(trace):
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            scheduler.add(pending.pop(0))
        batch = scheduler.next_batch(now)
        if batch is None:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        failed_at = overflow_step(batch, memory_limit)
        if failed_at is not None:
            runner.run_batch(batch, failed_at)
            stats.overflows += 1
            scheduler.requeue(split(batch))
            continue
        seconds = runner.run_batch(batch, batch.output_tokens)
        scheduler.observe(batch.shape(batch.output_tokens), seconds)
        stats.batches += 1
        stats.batch_sizes.append(len(batch.requests))
        finish = time.monotonic() - start
        completions.extend(Completion(r.request_id, r.arrival_s, finish) for r in batch.requests)
    return completions, stats


def replay_continuous(runner: EngineRunner, trace: list[StaticRequest], predicted: bool) -> list[Completion]:
    """Each request submitted at its arrival, generating its real length; its finish recorded."""
    completions: list[Completion] = []
    lock = threading.Lock()
    ended = threading.Semaphore(0)
    start = time.monotonic()

    def finisher(request: StaticRequest) -> Callable[[], None]:
        def on_finish() -> None:
            with lock:
                completions.append(
                    Completion(request.request_id, request.arrival_s, time.monotonic() - start)
                )
            ended.release()

        return on_finish

    for request in sorted(trace, key=lambda r: r.arrival_s):
        time.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
        runner.submit(request, request.output_tokens, finisher(request), predicted=predicted)
    for _ in trace:
        ended.acquire()
    return completions


def summary(completions: list[Completion]) -> dict:
    """Mean, median and p99 response time (arrival to the request's end) and requests per second
    over the run (first arrival to last end)."""
    latencies = sorted(c.finish_s - c.arrival_s for c in completions)
    span = max(c.finish_s for c in completions) - min(c.arrival_s for c in completions)
    return {
        "requests": len(completions),
        "mean_response_s": round(statistics.fmean(latencies), 3),
        "p50_response_s": round(latencies[len(latencies) // 2], 3),
        "p99_response_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "throughput_rps": round(len(completions) / span, 4),
    }
