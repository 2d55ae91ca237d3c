"""Each front end serves the version a request names (issue 52) and says which one served it: the
OpenAI ``system_fingerprint`` on the response and on every chunk, LoRAX's ``details``, the gRPC
stream's first message; an unknown version is a 404 naming it. A scripted worker (no model):
what is checked is which adapter id the gateway sends it and what the gateway answers."""

from __future__ import annotations

import json

from mesh_api.v1 import gateway_pb2, types_pb2
from tests.gateway.in_memory_store import gateway_grpc

OLD, NEW = "11" * 32, "22" * 32
ALICE = (("authorization", "Bearer key-alice"),)


def add_versions(gateway) -> None:
    """alice's ``tuned``: version 1 (id t1) and version 2 (id t2)."""
    for number, digest in ((1, OLD), (2, NEW)):
        gateway.store.adapters.append(
            types_pb2.AdapterInfo(id=f"t{number}", name="tuned", owner="alice", version=number, sha256=digest)
        )


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


async def test_openai_routes_serve_the_named_version_and_fingerprint_it(scripted_gateway):
    add_versions(scripted_gateway)
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Hello there")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    http = scripted_gateway.http
    expected = {
        "tuned": ("t2", "tuned@2 sha256:222222222222"),
        "tuned@1": ("t1", "tuned@1 sha256:111111111111"),
        f"tuned@sha256:{NEW[:12]}": ("t2", "tuned@2 sha256:222222222222"),
        f"tuned@sha256:{OLD}": ("t1", "tuned@1 sha256:111111111111"),
    }
    for model, (adapter_id, fingerprint) in expected.items():
        whole = await http.post("/v1/chat/completions", json={**chat, "model": model})
        assert whole.status_code == 200, whole.text
        assert whole.json()["system_fingerprint"] == fingerprint
        assert scripted_gateway.worker.requests[-1].adapter_id == adapter_id
    stream = await http.post("/v1/completions", json={"model": "tuned@1", "prompt": "Hi", "max_tokens": 2,
                                                      "stream": True})  # fmt: skip
    chunks = sse_events(stream.text)
    assert chunks and {c["system_fingerprint"] for c in chunks} == {"tuned@1 sha256:111111111111"}
    base_model = scripted_gateway.core.base_model
    base = await http.post("/v1/completions", json={"model": base_model, "prompt": "Hi", "max_tokens": 2})
    assert base.json()["system_fingerprint"] is None

    missing = await http.post("/v1/chat/completions", json={**chat, "model": "tuned@3"})
    assert missing.status_code == 404 and "'tuned@3' does not exist" in missing.json()["error"]["message"]
    bad = await http.post("/v1/chat/completions", json={**chat, "model": "tuned@latest"})
    assert bad.status_code == 400 and "a version is '@N'" in bad.json()["error"]["message"]


async def test_lorax_details_and_the_grpc_stream_name_the_version(scripted_gateway):
    add_versions(scripted_gateway)
    scripted_gateway.worker.script = scripted_gateway.core.encode(" Hello there")
    lorax = {"inputs": "Hi", "parameters": {"adapter_id": "tuned@1", "max_new_tokens": 2, "details": True}}
    whole = (await scripted_gateway.http.post("/generate", json=lorax)).json()
    assert whole["details"]["adapter_version"] == "tuned@1 sha256:111111111111"
    events = sse_events((await scripted_gateway.http.post("/generate_stream", json=lorax)).text)
    assert events[-1]["details"]["adapter_version"] == "tuned@1 sha256:111111111111"

    async with gateway_grpc(scripted_gateway.parts) as stub:
        request = gateway_pb2.GenerateTextRequest(
            prompt="Hi", adapter="tuned", sampling=types_pb2.SamplingParams(max_tokens=2)
        )
        replies = [r async for r in stub.Generate(request, metadata=ALICE)]
    assert replies[0].served_by == gateway_pb2.ServedVersion(
        adapter="tuned", version=2, sha256=NEW, adapter_id="t2", fingerprint="tuned@2 sha256:222222222222"
    )
    assert not any(r.HasField("served_by") for r in replies[1:])
