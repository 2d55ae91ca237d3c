"""Each sampling field of the OpenAI routes reaches the worker in the engine's sampling
parameters (a scripted worker records what it is sent), on chat and completions; values out of
range, ``logit_bias`` ids outside the vocabulary included, are a 400 naming the field before
anything reaches a worker."""

from __future__ import annotations

import pytest

CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "pirate", "prompt": "Hi", "max_tokens": 4}
ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture
def gateway(scripted_gateway):
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Ahoy")
    return scripted_gateway


def body(path: str, **fields) -> dict:
    return {**(CHAT if "chat" in path else COMPLETION), **fields}


FIELDS = {
    "presence_penalty": ({"presence_penalty": -0.75}, lambda s: s.presence_penalty == -0.75),
    "frequency_penalty": ({"frequency_penalty": 1.25}, lambda s: s.frequency_penalty == 1.25),
    "logit_bias": ({"logit_bias": {"42": -100, "1000": 7.5}}, lambda s: dict(s.logit_bias) == {42: -100.0, 1000: 7.5}),
    "min_p": ({"min_p": 0.125}, lambda s: s.min_p == 0.125),
    "top_k": ({"top_k": 12}, lambda s: s.top_k == 12),
    "top_k -1 (vLLM's off)": ({"top_k": -1}, lambda s: s.top_k == 0),
    "top_p": ({"top_p": 0.5}, lambda s: s.top_p == 0.5),
    "temperature": ({"temperature": 0.25}, lambda s: s.temperature == 0.25),
    "repetition_penalty": ({"repetition_penalty": 1.5}, lambda s: s.repetition_penalty == 1.5),
    "seed": ({"seed": 1234}, lambda s: s.HasField("seed") and s.seed == 1234),
}  # fmt: skip


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field", FIELDS, ids=list(FIELDS))
async def test_a_sampling_field_reaches_the_worker(gateway, field, path):
    fields, reached = FIELDS[field]
    reply = await gateway.http.post(path, json=body(path, **fields))
    assert reply.status_code == 200, reply.text
    [request] = gateway.worker.requests
    assert reached(request.sampling), request.sampling


async def test_every_field_at_once_reaches_the_worker_for_each_choice(gateway):
    fields = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"3": 1}, "min_p": 0.5, "n": 2}
    reply = await gateway.http.post("/v1/chat/completions", json=body("chat", **fields))
    assert reply.status_code == 200, reply.text
    assert len(gateway.worker.requests) == 2
    for request in gateway.worker.requests:
        sampling = request.sampling
        assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p) == (0.5, 0.5, 0.5)
        assert dict(sampling.logit_bias) == {3: 1.0}


OUT_OF_RANGE = {
    "presence_penalty": {"presence_penalty": 2.5},
    "frequency_penalty": {"frequency_penalty": -2.01},
    "min_p": {"min_p": -0.1},
    "top_k": {"top_k": -3},
    "logit_bias": {"logit_bias": {"42": 100.5}},
}


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field", OUT_OF_RANGE)
async def test_a_value_out_of_range_is_a_400_naming_the_field(gateway, field, path):
    reply = await gateway.http.post(path, json=body(path, **OUT_OF_RANGE[field]))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert gateway.worker.requests == []


@pytest.mark.parametrize("path", ROUTES)
async def test_a_logit_bias_id_outside_the_vocabulary_is_a_400_naming_logit_bias(gateway, path):
    vocab_size = gateway.core.tokenizer.vocab_size
    reply = await gateway.http.post(path, json=body(path, logit_bias={str(vocab_size): 1}))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "logit_bias" and f"[0, {vocab_size})" in error["message"]
    assert gateway.worker.requests == []
