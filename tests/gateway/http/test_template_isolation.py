"""A tenant's adapter whose chat template loops for minutes costs only its own requests: each is
refused (400, ``failed_precondition``) in one line naming the adapter's template and the budget
it went over, on every route that renders it, and another tenant's chats on the same gateway
are answered meanwhile, the same as without it."""

from __future__ import annotations

import asyncio

import pytest

from mesh_api.v1 import types_pb2

MINUTES_OF_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LOOPER = types_pb2.AdapterInfo(
    id="b9",
    name="looper",
    owner="bob",
    visibility=types_pb2.VISIBILITY_PUBLIC,
    chat_template=MINUTES_OF_LOOPS,
)
REFUSAL = (
    "the chat template of adapter 'bob/looper' is over the gateway's template budget: "
    "more than 100000 operations (--chat-template-max-operations)"
)
BOB = {"authorization": "Bearer key-bob"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def gateway(scripted_gateway):
    scripted_gateway.store.adapters.append(LOOPER)
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Ahoy")
    return scripted_gateway


async def bob_chat(gateway, model: str = "looper"):
    return await gateway.http.post("/v1/chat/completions", json={"model": model, "messages": HI}, headers=BOB)


async def alice_chat(gateway, model: str = "pirate"):
    return await gateway.http.post("/v1/chat/completions", json={"model": model, "messages": HI})


async def test_a_chat_with_a_template_over_budget_is_refused_naming_the_template(gateway):
    reply = await bob_chat(gateway)
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": REFUSAL,
        "type": "invalid_request_error",
        "param": None,
        "code": "failed_precondition",
    }
    tokenized = await gateway.http.post("/tokenize", json={"model": "looper", "messages": HI}, headers=BOB)
    assert (tokenized.status_code, tokenized.json()["error"]["message"]) == (400, REFUSAL)
    # another tenant may use the public adapter: its template is refused for them too
    assert (await alice_chat(gateway, "bob/looper")).json()["error"]["message"] == REFUSAL
    assert not gateway.worker.requests  # nothing was generated


async def test_another_tenant_s_chats_are_answered_while_the_looping_ones_are_refused(gateway):
    bobs = [asyncio.ensure_future(bob_chat(gateway)) for _ in range(4)]
    alices = [asyncio.ensure_future(alice_chat(gateway, model)) for model in ("pirate", "", "bob/shared")]
    for reply in await asyncio.gather(*alices):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == " Ahoy"
    assert [r.json()["error"]["message"] for r in await asyncio.gather(*bobs)] == [REFUSAL] * 4
    assert (await bob_chat(gateway, "shared")).status_code == 200  # bob's other adapters serve on
