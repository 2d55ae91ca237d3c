"""Every HTTP dialect resolves the adapter a request names once, however many choices it asks
for, and hands that resolution on (chat template, generation)."""

from __future__ import annotations

import pytest

from services.gateway.adapter_catalog import AdapterCatalog

CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2}
COMPLETION = {"model": "pirate", "prompt": ["Hi", "Ho"], "max_tokens": 2, "n": 2}
LORAX = {"inputs": "Hi", "parameters": {"adapter_id": "pirate", "max_new_tokens": 2}}
TOKENIZE = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETION),
        ("/generate", LORAX),
        ("/tokenize", TOKENIZE),
    ],
)
async def test_a_request_resolves_its_adapter_once(scripted_gateway, monkeypatch, path, body):
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Ahoy")
    resolved: list[str] = []
    resolve = AdapterCatalog.resolve

    async def counted(catalog, tenant, reference):
        resolved.append(reference)
        return await resolve(catalog, tenant, reference)

    monkeypatch.setattr(AdapterCatalog, "resolve", counted)
    reply = await scripted_gateway.http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert resolved == ["pirate"]
    expected = set() if path == "/tokenize" else {"a1"}
    assert {r.adapter_id for r in scripted_gateway.worker.requests} == expected
