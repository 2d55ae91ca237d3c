"""The gateway's per-request series as its OpenAI front end drives the core: a generation that
ends in its first message (its reader closes it right after) is counted as ended, not
cancelled; a client that leaves mid-stream is counted CANCELLED."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from support.prometheus_scrape import Scrape

from mesh_api.v1 import types_pb2


def scrape(gateway) -> Scrape:
    registry = CollectorRegistry()
    registry.register(gateway.core.metrics)
    return Scrape(generate_latest(registry).decode())


async def test_generations_are_counted_by_how_they_ended(scripted_gateway):
    gateway = scripted_gateway
    gateway.worker.script = gateway.core.encode(" one two three")
    for max_tokens in (1, 3):
        reply = await gateway.http.post(
            "/v1/completions", json={"model": "pirate", "prompt": "Hi", "max_tokens": max_tokens}
        )
        assert reply.status_code == 200, reply.text
    left = gateway.core.generate("alice", [1, 2], None, types_pb2.SamplingParams(max_tokens=3))
    await anext(left)
    await left.aclose()  # the client went away after one token

    got = scrape(gateway)
    pirate = {"adapter": "alice/pirate", "tenant": "alice"}
    assert got.value("loramesh_gateway_generations_total", code="OK", **pirate) == 2
    assert got.value("vllm:e2e_request_latency_seconds_count", **pirate) == 2
    assert got.value("vllm:generation_tokens_total", **pirate) == 4
    assert got.value("loramesh_gateway_generations_total", adapter="", code="CANCELLED") == 1
