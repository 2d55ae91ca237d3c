"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on a real gateway core (the SmolLM2
tokenizer, no worker needed): vLLM's request and response shapes, prompts and chat messages,
adapters as ``model``; refusals name the field."""

from __future__ import annotations

import pytest

TEXT = "Café 🎉 naïve"
MESSAGES = [{"role": "user", "content": "Hi"}]


async def test_tokenize_a_prompt_answers_vllms_shape(scripted_gateway):
    core = scripted_gateway.core
    reply = await scripted_gateway.http.post("/tokenize", json={"model": core.base_model, "prompt": TEXT})
    assert reply.status_code == 200, reply.text
    tokens = core.encode(TEXT, add_special_tokens=True)
    assert reply.json() == {
        "count": len(tokens),
        "max_model_len": core.context_length,
        "tokens": tokens,
        "token_strs": None,
    }


@pytest.mark.parametrize("model", ["pirate", "alice/pirate", "bob/shared", None])
async def test_an_adapter_the_key_may_use_tokenizes_as_the_base_model(scripted_gateway, model):
    reply = await scripted_gateway.http.post("/tokenize", json={"model": model, "prompt": TEXT})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == scripted_gateway.core.encode(TEXT, add_special_tokens=True)


async def test_tokenize_messages_through_the_chat_template(scripted_gateway):
    core, http = scripted_gateway.core, scripted_gateway.http
    reply = await http.post("/tokenize", json={"model": "pirate", "messages": MESSAGES})
    assert reply.json()["tokens"] == await core.chat_prompt("alice", [("user", "Hi")])  # what a chat sends
    without = await http.post(
        "/tokenize", json={"model": "pirate", "messages": MESSAGES, "add_generation_prompt": False}
    )
    expected = await core.chat_prompt("alice", [("user", "Hi")], add_generation_prompt=False)
    assert without.json()["tokens"] == expected and without.json()["count"] < reply.json()["count"]


async def test_detokenize_gives_the_text_back(scripted_gateway):
    tokens = scripted_gateway.core.encode(TEXT)
    reply = await scripted_gateway.http.post("/detokenize", json={"model": "pirate", "tokens": tokens})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": TEXT}
    empty = await scripted_gateway.http.post("/detokenize", json={"model": "pirate", "tokens": []})
    assert empty.json() == {"prompt": ""}


REFUSED = {
    "an id past the vocabulary": ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    "a negative id": ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    "tokens that are no ids": ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    "no tokens": ("/detokenize", {}, 400, "tokens"),
    "neither prompt nor messages": ("/tokenize", {}, 400, "prompt"),
    "both prompt and messages": ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages"),
    "a bad role": ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    "return_token_strs": ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
    "continue_final_message": ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400,
                               "continue_final_message"),
    "chat_template": ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, 400, "chat_template"),
    "an unknown model": ("/tokenize", {"model": "nobody/nothing", "prompt": "x"}, 404, "model"),
    "another tenant's private adapter": ("/detokenize", {"model": "bob/secret", "tokens": [1]}, 404, "model"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
async def test_refusals_name_the_field(scripted_gateway, case):
    path, body, status, param = REFUSED[case]
    reply = await scripted_gateway.http.post(path, json={"model": "pirate", **body})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_a_key_is_needed(scripted_gateway, path):
    reply = await scripted_gateway.http.post(
        path, json={"prompt": "x", "tokens": [1]}, headers={"authorization": ""}
    )
    assert reply.status_code == 401
