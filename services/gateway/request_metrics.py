"""The gateway's per-request series, under vLLM's names: latency histograms (first token,
between tokens, end to end, queue time on the worker) and prompt and generation token counters,
labelled with the base model (``model_name``, as vLLM labels them), the adapter (capped:
:mod:`services.runtime.capped_series`) and the tenant, plus each generation's outcome.

The gateway is where a request's whole life is seen (every placement, resume and migration of it)
and the only service that knows its tenant, so these are measured here, from the moment the core
takes the generation (after tokenizing its prompt, before the tenant's quota admits it) to its
last message. docs/metrics.md lists them; the alert rules in k8s/base read them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from services.runtime.capped_labels import DEFAULT_CAP, CappedLabels
from services.runtime.capped_series import CappedCounter, CappedHistogram

BASE_MODEL = ""
"""The ``adapter`` label of a request for the base model itself."""
FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
"""vLLM's buckets for ``vllm:time_to_first_token_seconds``."""
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
"""vLLM's buckets for ``vllm:inter_token_latency_seconds``."""
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
"""vLLM's buckets for its request-level latencies (end to end, queue time)."""
TENANT = ("tenant",)
OK = "OK"
"""The ``code`` of a generation that ended normally (any finish reason)."""


class RequestMetrics:
    """The series, and a :class:`GenerationTimer` per generation that observes into them."""

    def __init__(self, adapter_label_cap: int = DEFAULT_CAP, clock: Callable[[], float] = time.monotonic):
        """``adapter_label_cap``: adapters named in each series (the rest: ``other``);
        ``clock``: monotonic seconds (tests pass a fake one)."""
        if adapter_label_cap < 1:  # refused at start, not at the first scrape
            raise ValueError(f"the adapter label cap must be at least 1, got {adapter_label_cap}")
        self.adapter_label_cap = adapter_label_cap
        self.clock = clock
        self.model_name = ""
        """The base model's name (set once the gateway has loaded its tokenizer)."""
        self._requests: dict[str, int] = {}
        """Generations per adapter so far: the ranking of the capped labels."""
        self.first_token = CappedHistogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TENANT,
            FIRST_TOKEN_BUCKETS_S,
        )
        self.inter_token = CappedHistogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TENANT,
            INTER_TOKEN_BUCKETS_S,
        )
        self.end_to_end = CappedHistogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            TENANT,
            REQUEST_BUCKETS_S,
        )
        self.queue_time = CappedHistogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            TENANT,
            REQUEST_BUCKETS_S,
        )
        self.prompt_tokens = CappedCounter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", TENANT
        )
        self.generation_tokens = CappedCounter(
            "vllm:generation_tokens", "Number of generation tokens processed.", TENANT
        )
        self.generations = CappedCounter(
            "loramesh_gateway_generations",
            "Generations by final status code (OK, or the gRPC code of the refusal or failure)",
            (*TENANT, "code"),
        )

    def start(self, tenant: str, adapter: str) -> GenerationTimer:
        """A generation of ``tenant`` with ``adapter`` (its ``owner/name``; :data:`BASE_MODEL`)
        begins now."""
        self._requests[adapter] = self._requests.get(adapter, 0) + 1
        return GenerationTimer(self, adapter, (tenant,), self.clock())

    def collect(self) -> Iterator[Metric]:
        histograms = (self.first_token, self.inter_token, self.end_to_end, self.queue_time)
        counters = (self.prompt_tokens, self.generation_tokens, self.generations)
        capped = CappedLabels(self._requests, self._requests, self.adapter_label_cap)
        fixed = {"model_name": self.model_name}
        for series in (*histograms, *counters):
            yield series.family(capped, fixed)


@dataclass
class GenerationTimer:
    """One generation's observations."""

    metrics: RequestMetrics
    adapter: str
    labels: tuple[str, ...]
    started: float
    last_token: float | None = None
    """When the latest tokens arrived (None: none yet)."""
    ended: bool = False

    def tokens(self, count: int, prompt_tokens: int) -> None:
        """``count`` tokens arrived together (one message): the first ones give the time to first
        token (and count the prompt as processed), later ones share the gap since the previous."""
        if not count:
            return
        metrics, now = self.metrics, self.metrics.clock()
        if self.last_token is None:
            metrics.first_token.observe(self.adapter, self.labels, now - self.started)
            metrics.prompt_tokens.inc(self.adapter, self.labels, prompt_tokens)
        else:
            metrics.inter_token.observe(self.adapter, self.labels, (now - self.last_token) / count, count)
        metrics.generation_tokens.inc(self.adapter, self.labels, count)
        self.last_token = now

    def queued(self, seconds: float) -> None:
        """A worker reported the request waited ``seconds`` in its queue before it was scheduled
        (0: it was never scheduled there, not observed)."""
        if seconds > 0:
            self.metrics.queue_time.observe(self.adapter, self.labels, seconds)

    def end(self, code: str) -> None:
        """The generation is over with ``code`` (:data:`OK`, else a gRPC status code's name);
        later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        metrics = self.metrics
        metrics.generations.inc(self.adapter, (*self.labels, code))
        if code == OK:
            metrics.end_to_end.observe(self.adapter, self.labels, metrics.clock() - self.started)
