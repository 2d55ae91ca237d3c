"""The gateway's per-request series (vLLM's names) on their own, with a fake clock."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from support.prometheus_scrape import Scrape

from services.gateway.request_metrics import BASE_MODEL, OK, RequestMetrics
from services.runtime.capped_labels import OTHER


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape(metrics: RequestMetrics) -> Scrape:
    registry = CollectorRegistry()
    registry.register(metrics)
    return Scrape(generate_latest(registry).decode())


def test_latencies_and_tokens_are_observed_per_adapter_and_tenant():
    clock = FakeClock()
    clock.now = 0.0  # sums exact in binary: 0.25, 0.5
    metrics = RequestMetrics(clock=clock)
    metrics.model_name = "base"
    timer = metrics.start("alice", "alice/pirate")
    clock.now += 0.25
    timer.tokens(1, prompt_tokens=7)
    clock.now += 0.5
    timer.tokens(2, prompt_tokens=7)  # two tokens in one message: 0.25 s each
    timer.queued(0.05)
    timer.queued(0.0)  # never scheduled on that worker: not observed
    timer.end(OK)
    timer.end("UNAVAILABLE")  # ended once
    metrics.start("bob", BASE_MODEL).end("RESOURCE_EXHAUSTED")

    got = scrape(metrics)
    alice = {"model_name": "base", "adapter": "alice/pirate", "tenant": "alice"}
    assert got.value("vllm:time_to_first_token_seconds_count", **alice) == 1
    assert got.value("vllm:time_to_first_token_seconds_sum", **alice) == 0.25
    assert got.value("vllm:inter_token_latency_seconds_count", **alice) == 2
    assert got.value("vllm:inter_token_latency_seconds_sum", **alice) == 0.5
    assert got.value("vllm:inter_token_latency_seconds_bucket", le="0.2", **alice) == 0
    assert got.value("vllm:inter_token_latency_seconds_bucket", le="0.3", **alice) == 2
    assert got.value("vllm:e2e_request_latency_seconds_count", **alice) == 1
    assert got.value("vllm:request_queue_time_seconds_count", **alice) == 1
    assert got.value("vllm:prompt_tokens_total", **alice) == 7
    assert got.value("vllm:generation_tokens_total", **alice) == 3
    assert got.value("loramesh_gateway_generations_total", code=OK, **alice) == 1
    assert got.value("loramesh_gateway_generations_total", tenant="bob", adapter="") == 1
    assert got.value("loramesh_gateway_generations_total", tenant="bob", code="RESOURCE_EXHAUSTED") == 1
    assert got.value("vllm:e2e_request_latency_seconds_count", tenant="bob") is None  # refused: no latency


def test_adapters_past_the_cap_share_the_other_label():
    metrics = RequestMetrics(adapter_label_cap=1, clock=FakeClock())
    for adapter, requests in (("o/busy", 3), ("o/quiet", 1), ("o/rare", 1)):
        for _ in range(requests):
            metrics.start("alice", adapter).tokens(2, prompt_tokens=1)
    got = scrape(metrics)
    assert got.by_label("vllm:generation_tokens_total", "adapter") == {"o/busy": 6, OTHER: 4}
    assert got.by_label("vllm:time_to_first_token_seconds_count", "adapter") == {"o/busy": 3, OTHER: 2}
