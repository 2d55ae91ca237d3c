"""vLLM's server routes on the OpenAI port (``/health``, ``/ping``, ``/version``, ``/metrics``,
no API key needed) and ``/v1/models/{name}`` / ``/v1/models/{owner}/{name}``, on a real gateway
core and app in this process."""

from __future__ import annotations

import httpx
from prometheus_client import CONTENT_TYPE_LATEST

from mesh_api.version import VERSION
from services.gateway.http.app import build_app
from tests.gateway.in_memory_store import InMemoryStore, gateway_parts

NO_KEY = {"authorization": ""}


async def test_health_ping_and_version_answer_as_vllms_without_a_key(scripted_gateway):
    http = scripted_gateway.http
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        reply = await http.request(method, path, headers=NO_KEY)
        assert (reply.status_code, reply.content) == (200, b""), (method, path)
    version = await http.get("/version", headers=NO_KEY)
    assert version.status_code == 200 and version.json() == {"version": VERSION}


async def test_health_is_503_until_the_gateway_can_serve():
    parts = gateway_parts("", InMemoryStore())  # not attached yet
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(parts)), base_url="http://g"
    ) as http:
        assert (await http.get("/health")).status_code == 503
        assert (await http.get("/ping")).status_code == 503
        assert (await http.get("/metrics")).status_code == 404  # no registry given: no /metrics


async def test_metrics_serves_the_gateways_registry(scripted_gateway):
    scripted_gateway.metrics.observe_rpc("Generate", "OK", 0.25)
    reply = await scripted_gateway.http.get("/metrics", headers=NO_KEY)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == CONTENT_TYPE_LATEST
    assert reply.content == await scripted_gateway.metrics.exposition()
    assert 'loramesh_rpc_total{code="OK",method="Generate",service="gateway"} 1.0' in reply.text


async def test_a_model_is_retrieved_by_name_or_by_owner_and_name(scripted_gateway):
    http = scripted_gateway.http
    base = scripted_gateway.core.base_model
    own = (await http.get("/v1/models/pirate")).json()
    assert own == {"id": "pirate", "object": "model", "created": 1_700_000_000, "owned_by": "alice",
                   "root": "pirate", "parent": base}  # fmt: skip
    assert (await http.get("/v1/models/alice/pirate")).json() == own  # the same model, as listed
    shared = (await http.get("/v1/models/bob/shared")).json()
    assert shared["id"] == "bob/shared" and shared["owned_by"] == "bob"
    assert (await http.get(f"/v1/models/{base}")).json()["parent"] is None
    listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [base, "pirate", "bob/shared"]


async def test_a_missing_or_invisible_model_is_openais_404(scripted_gateway):
    http = scripted_gateway.http
    for path in (
        "/v1/models/bob/secret",
        "/v1/models/nobody/nothing",
        "/v1/models/nothing",
        "/v1/models/a/b/c",
    ):
        reply = await http.get(path)
        assert reply.status_code == 404, path
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "does not exist or you do not have access to it" in error["message"]
    as_bob = await http.get("/v1/models/alice/pirate", headers={"authorization": "Bearer key-bob"})
    assert as_bob.status_code == 404
