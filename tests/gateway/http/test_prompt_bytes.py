"""A prompt over ``--max-prompt-bytes`` is refused on every HTTP route that tokenizes one (400
naming the field and the limit) before any of it is tokenized; one at the limit is served."""

from __future__ import annotations

import pytest

from services.gateway.config import GatewayConfig

LIMIT = GatewayConfig().max_prompt_bytes
OVER_IN_BYTES = "é" * (LIMIT // 2 + 1)  # fewer characters than the limit, more bytes
OVER_IN_CHARACTERS = "x" * (LIMIT + 1)

ROUTES = {
    "completions": ("/v1/completions", lambda text: {"model": "pirate", "prompt": text}, "prompt"),
    "completions, a list": ("/v1/completions", lambda text: {"model": "pirate", "prompt": ["Hi", text]}, "prompt"),
    "chat": ("/v1/chat/completions",
             lambda text: {"model": "pirate", "messages": [{"role": "user", "content": text}]}, "messages"),
    "chat, across messages": ("/v1/chat/completions", lambda text: {
        "model": "pirate",
        "messages": [{"role": "user", "content": text[: len(text) // 2]},
                     {"role": "assistant", "content": text[len(text) // 2 :]}],
    }, "messages"),
    "tokenize": ("/tokenize", lambda text: {"prompt": text}, "prompt"),
    "tokenize messages": ("/tokenize", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
}  # fmt: skip


@pytest.fixture
def untokenized(scripted_gateway, monkeypatch):
    """The gateway, with a tokenizer that fails the test if anything is tokenized."""

    def tokenized(*args, **kwargs):
        raise AssertionError("a prompt over the limit was tokenized")

    monkeypatch.setattr(scripted_gateway.core, "encode", tokenized)
    return scripted_gateway


@pytest.mark.parametrize("route", ROUTES, ids=list(ROUTES))
@pytest.mark.parametrize(
    ("text", "size"),
    [(OVER_IN_BYTES, str(LIMIT + 2)), (OVER_IN_CHARACTERS, f"over {LIMIT}")],
    ids=["bytes", "chars"],
)
async def test_a_prompt_over_the_limit_is_refused_before_it_is_tokenized(untokenized, route, text, size):
    path, body, field = ROUTES[route]
    reply = await untokenized.http.post(path, json=body(text))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field
    assert error["message"] == f"{field} is {size} bytes; the limit is {LIMIT} (--max-prompt-bytes)"


async def test_lorax_inputs_over_the_limit_are_refused_before_they_are_tokenized(untokenized):
    reply = await untokenized.http.post("/generate", json={"inputs": OVER_IN_BYTES})
    assert reply.status_code == 422, reply.text  # LoRAX's status for a bad request
    assert reply.json() == {
        "error": f"inputs is {LIMIT + 2} bytes; the limit is {LIMIT} (--max-prompt-bytes)",
        "error_type": "validation",
    }


async def test_a_prompt_at_the_limit_is_tokenized(scripted_gateway):
    reply = await scripted_gateway.http.post("/tokenize", json={"prompt": "é" * (LIMIT // 2)})
    assert reply.status_code == 200, reply.text
    assert reply.json()["count"] > 0
