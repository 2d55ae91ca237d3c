"""The official ``openai`` package against the gateway's OpenAI API on a real mesh: sync and
async, streaming and not, chat and completion, adapters as ``model``; greedy tokens equal the
gRPC path's; n, seeds, stop strings and usage; an uploaded chat template that loops for minutes
refused for its own chats only; vLLM's adapter loading (relative paths under the
load dirs) and server routes (``/health``, ``/ping``, ``/version``, ``/metrics``); a disconnect
cancels."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from grpc import aio
from support.prometheus_scrape import Scrape, scrape

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient, Client, errors
from mesh_api.v1 import worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.model]

BASE_MODEL = "SmolLM2-135M-Instruct"

HANG_GUARD_S = 120.0
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
TOKEN_IDS = {"return_token_ids": True}  # vLLM's extension: each choice carries its token ids


def sync_client(mesh, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.openai_base_url, api_key=key, max_retries=0, timeout=HANG_GUARD_S)


def async_client(mesh, key: str = "key-alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.openai_base_url, api_key=key, max_retries=0, timeout=HANG_GUARD_S)


def test_streamed_chat_from_an_adapter_equals_the_grpc_path(mesh):
    with sync_client(mesh) as client:
        stream = client.chat.completions.create(
            model="pirate",
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=TOKEN_IDS,
        )
        chunks = list(stream)
    with Client(mesh.gateway.address, "key-alice") as grpc_client:
        expected = grpc_client.chat(QUESTION, adapter="pirate", max_tokens=16, temperature=0.0)
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    assert [t for c in choices for t in c.token_ids] == list(expected.token_ids)
    assert "".join(c.delta.content or "" for c in choices) == expected.text
    assert choices[-1].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_streamed_and_not_name_each_token_with_its_top_alternatives(mesh):
    with sync_client(mesh) as client:
        ask = {
            "model": "pirate",
            "messages": QUESTION,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        }
        stream = client.chat.completions.create(**ask, stream=True, extra_body=TOKEN_IDS)
        choices = [c.choices[0] for c in stream if c.choices]
        whole = client.chat.completions.create(**ask, extra_body=TOKEN_IDS).choices[0]
        legacy = client.completions.create(
            model="pirate",
            prompt="The rainbow has",
            max_tokens=5,
            temperature=0,
            logprobs=2,
            extra_body=TOKEN_IDS,
        ).choices[0]
    streamed = [entry for c in choices if c.logprobs for entry in c.logprobs.content]
    token_ids = [t for c in choices for t in c.token_ids]
    assert len(streamed) == len(token_ids) == len(whole.logprobs.content) == len(whole.token_ids)
    for entry, same in zip(streamed, whole.logprobs.content, strict=True):
        assert entry.token == same.token and abs(entry.logprob - same.logprob) < 1e-5
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the chosen token is the most likely one, and the alternatives come best first.
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert [a.logprob for a in entry.top_logprobs] == sorted(
            (a.logprob for a in entry.top_logprobs), reverse=True
        )
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    lp = legacy.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(legacy.token_ids) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(top) <= 2 for top in lp.top_logprobs)


async def test_async_completions_streamed_and_not_equal_the_grpc_path(mesh):
    prompt = "The three primary colours are"
    async with async_client(mesh) as client:
        whole = await client.completions.create(
            model="french", prompt=prompt, max_tokens=12, temperature=0, extra_body=TOKEN_IDS
        )
        stream = await client.completions.create(
            model="french", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=TOKEN_IDS
        )
        chunks = [chunk async for chunk in stream]
    with Client(mesh.gateway.address, "key-alice") as grpc_client:
        expected = grpc_client.generate(prompt, adapter="french", max_tokens=12, temperature=0.0)
    assert whole.choices[0].token_ids == list(expected.token_ids)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    assert [t for c in chunks for t in c.choices[0].token_ids] == list(expected.token_ids)
    assert "".join(c.choices[0].text for c in chunks) == expected.text


async def test_concurrent_chats_for_base_and_adapters_are_each_their_own(mesh):
    async with async_client(mesh) as client:
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0)
                for model in (BASE_MODEL, "pirate", "french", BASE_MODEL)
            )
        )
    texts = [r.choices[0].message.content for r in replies]
    assert texts[0] == texts[3]  # greedy: the same model gives the same answer in any batch
    assert len({texts[0], texts[1], texts[2]}) == 3, texts  # each adapter changes the answer
    assert all(r.object == "chat.completion" and r.usage.total_tokens > 0 for r in replies)


def test_an_uploaded_template_that_loops_for_minutes_fails_its_own_chats_only(mesh, base_spec, tmp_path):
    looper = write_peft_adapter(tmp_path / "looper", base_spec, SampleAdapterSpec(rank=4, seed=21))
    (looper / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    refusal = (
        "the chat template of adapter 'bob/looper' is over the gateway's template budget: "
        "more than 100000 operations (--chat-template-max-operations)"
    )
    with Client(mesh.gateway.address, "key-bob") as bob:
        bob.adapters.upload(looper, "looper")
        try:
            with pytest.raises(errors.FailedPrecondition, match=re.escape(refusal)):
                bob.chat(QUESTION, adapter="looper", max_tokens=4)
            with sync_client(mesh, "key-bob") as client, pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="looper", messages=QUESTION, max_tokens=4)
            assert refused.value.body == {
                "message": refusal,
                "type": "invalid_request_error",
                "param": None,
                "code": "failed_precondition",
            }
            with sync_client(mesh) as client:  # alice, on the same gateway
                reply = client.chat.completions.create(
                    model="pirate", messages=QUESTION, max_tokens=4, temperature=0
                )
            assert reply.choices[0].message.content
        finally:
            bob.adapters.delete("looper")  # the other tests list bob's adapters


def test_models_lists_the_base_and_the_adapters_the_key_may_use(mesh):
    with sync_client(mesh) as alice, sync_client(mesh, "key-bob") as bob:
        alice_models = {m.id: m for m in alice.models.list()}
        bob_ids = {m.id for m in bob.models.list()}
        assert alice.models.retrieve("pirate").owned_by == "alice"
    assert set(alice_models) == {BASE_MODEL, "pirate", "french"}
    assert alice_models["pirate"].parent == BASE_MODEL  # type: ignore[attr-defined]
    assert bob_ids == {BASE_MODEL, "secret"}


def test_a_model_is_retrieved_by_owner_and_name_and_only_by_whom_may_see_it(mesh):
    with sync_client(mesh) as alice, sync_client(mesh, "key-bob") as bob:
        assert alice.models.retrieve("alice/pirate") == alice.models.retrieve("pirate")
        assert alice.models.retrieve("alice/pirate").id == "pirate"  # as /v1/models lists it
        with pytest.raises(openai.NotFoundError):
            bob.models.retrieve("alice/pirate")


def test_n_seed_and_stop(mesh):
    with sync_client(mesh) as client:

        def sample():
            return client.completions.create(
                model=BASE_MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, n=3
            )

        first, again = sample(), sample()
        stopped = client.completions.create(
            model=BASE_MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0, stop=[" 5"]
        )
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # choice j samples with seed + j
    assert first.usage.prompt_tokens == 4 and 3 <= first.usage.completion_tokens <= 24
    assert stopped.choices[0].finish_reason == "stop" and " 5" not in stopped.choices[0].text
    assert " 4" in stopped.choices[0].text


def test_vllm_load_and_unload_lora_adapter(mesh, adapter_dirs):
    auth = {"Authorization": "Bearer key-alice"}
    with httpx.Client(base_url=mesh.openai_base_url, headers=auth, timeout=HANG_GUARD_S) as http:
        loaded = http.post(
            "/load_lora_adapter", json={"lora_name": "loaded", "lora_path": str(adapter_dirs["secret"])}
        )
        assert loaded.status_code == 200, loaded.text
        assert "loaded" in loaded.text
        with sync_client(mesh) as client:
            assert "loaded" in {m.id for m in client.models.list()}
            reply = client.completions.create(model="loaded", prompt="Hello", max_tokens=4, temperature=0)
            assert reply.usage.completion_tokens >= 1
        outside = http.post("/load_lora_adapter", json={"lora_name": "etc", "lora_path": "/etc"})
        assert outside.status_code == 403 and "may load adapters from" in outside.json()["error"]["message"]
        as_bob = http.post(
            "/load_lora_adapter",
            json={"lora_name": "loaded", "lora_path": str(adapter_dirs["secret"])},
            headers={"Authorization": "Bearer key-bob"},
        )
        assert as_bob.status_code == 403  # a path load is an import: the policy grants bob nothing
        assert "tenant 'bob' may not import from file://" in as_bob.json()["error"]["message"]
        unloaded = http.post("/unload_lora_adapter", json={"lora_name": "loaded"})
        assert unloaded.status_code == 200, unloaded.text
        gone = http.post("/completions", json={"model": "loaded", "prompt": "Hello", "max_tokens": 2})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_vllm_load_lora_adapter_resolves_a_relative_path_under_the_load_dirs(mesh, adapter_root):
    """The gateway runs elsewhere than the adapters' directory: a relative ``lora_path`` is
    looked up under ``--adapter-load-dirs`` (``adapter_root``), and one leading out of it is
    refused, however it is spelled."""
    auth = {"Authorization": "Bearer key-alice"}
    with httpx.Client(base_url=mesh.openai_base_url, headers=auth, timeout=HANG_GUARD_S) as http:
        loaded = http.post("/load_lora_adapter", json={"lora_name": "relative", "lora_path": "secret"})
        assert loaded.status_code == 200, loaded.text
        assert http.get("/models/alice/relative").json()["parent"] == BASE_MODEL
        assert http.post("/unload_lora_adapter", json={"lora_name": "relative"}).status_code == 200
        for escape in ("..", f"../{adapter_root.name}/../..", "../../etc"):
            refused = http.post("/load_lora_adapter", json={"lora_name": "escape", "lora_path": escape})
            assert refused.status_code == 403, (escape, refused.text)


async def test_vllm_server_routes_serve_the_gateways_own_metrics(mesh):
    async with AsyncClient(mesh.gateway.address, "key-alice") as grpc_client:
        await grpc_client.generate("Hi", max_tokens=1)
    root = mesh.openai_base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=HANG_GUARD_S) as http:  # no key needed
        health, ping = await http.get("/health"), await http.post("/ping")
        assert (health.status_code, health.content, ping.status_code, ping.content) == (200, b"", 200, b"")
        assert set((await http.get("/version")).json()) == {"version"}
        served = await http.get("/metrics")
    side_port = await scrape(mesh.gateway.http_address)

    def generate_rpcs(metrics: Scrape) -> list:
        return [s for s in metrics.series("loramesh_rpc_total") if s.labels["method"] == "Generate"]

    assert generate_rpcs(side_port) and generate_rpcs(Scrape(served.text)) == generate_rpcs(side_port)


async def first_event(lines) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended before its first event")


async def test_a_client_disconnect_cancels_the_request_and_frees_its_pages(mesh):
    """Two equal long streams start together; one client hangs up. The worker must drop to one
    running request while the other stream goes on: equal requests would end together, so only
    the cancellation can end the first one early."""
    body = {"model": "pirate", "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    auth = {"Authorization": "Bearer key-alice"}
    worker = mesh.workers[0].address
    async with (
        httpx.AsyncClient(base_url=mesh.openai_base_url, timeout=HANG_GUARD_S) as http,
        http.stream("POST", "/completions", json=body, headers=auth) as kept,
    ):
        kept_lines = kept.aiter_lines()
        async with http.stream("POST", "/completions", json=body, headers=auth) as dropped:
            # Held until the hang-up: a line iterator collected half-read closes its response,
            # which hangs up at once (under load, before the test saw both requests run).
            dropped_lines = dropped.aiter_lines()
            await asyncio.gather(first_event(kept_lines), first_event(dropped_lines))
            await wait_for_stats(worker, lambda s: s.running == 2)
        stats = await wait_for_stats(worker, lambda s: s.running == 1)  # the dropped one is gone
        assert stats.kv_pages > 0
        assert (await first_event(kept_lines)).startswith("data: {")  # the kept one still streams
    await wait_for_stats(worker, lambda s: s.running == 0 and s.queue == 0 and s.kv_pages == 0)


async def test_a_client_disconnect_before_a_whole_response_cancels_it_too(mesh):
    """Non-streaming: the client hangs up while its answer is being generated."""
    body = {"model": BASE_MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    worker = mesh.workers[0].address
    whole = json.dumps({**body, "stream": False}).encode()
    async with (
        httpx.AsyncClient(base_url=mesh.openai_base_url, timeout=HANG_GUARD_S) as http,
        http.stream("POST", "/completions", json=body, headers={"Authorization": "Bearer key-alice"}) as kept,
    ):
        kept_lines = kept.aiter_lines()
        await first_event(kept_lines)
        _, writer = await asyncio.open_connection("127.0.0.1", mesh.openai_port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer key-alice\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(whole), whole)
        )
        await writer.drain()
        await wait_for_stats(worker, lambda s: s.running == 2)
        writer.close()  # hang up before the answer
        await writer.wait_closed()
        await wait_for_stats(worker, lambda s: s.running == 1)
        assert (await first_event(kept_lines)).startswith("data: {")  # the kept one still streams
    await wait_for_stats(worker, lambda s: s.running == 0 and s.queue == 0 and s.kv_pages == 0)


async def wait_for_stats(address: str, condition) -> worker_pb2.WorkerStatsResponse:
    """The worker's stats once ``condition`` holds (``HANG_GUARD_S`` only turns a hang into a failure)."""
    deadline = time.monotonic() + HANG_GUARD_S
    async with aio.insecure_channel(address) as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        while True:
            stats = await worker.Stats(worker_pb2.WorkerStatsRequest())
            if condition(stats):
                return stats
            assert time.monotonic() < deadline, f"worker stats never met the condition: {stats}"
            await asyncio.sleep(0.1)
