"""Prefix-cache isolation between tenants (issue 50) through a real gateway and a real worker:
the gateway's servicer, core, relay and OpenAI routes in this process, with the SmolLM2
tokenizer, in front of a worker on loopback whose engine (prefix cache on, 4-token blocks) runs a
tiny random Llama with SmolLM2's vocabulary.

No timing is measured: the worker's own accounting says what a request reused, its
``cached_prompt_tokens`` (the usage's, OpenAI's ``prompt_tokens_details.cached_tokens``) and the
cache's hit counter. A prompt alice sent gives bob nothing by default, gives alice herself its
blocks, and is shared between them only when both pass the same ``cache_salt``.
bench/prefix_cache_isolation_bench.py measures what that means for time to first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
import torch
from grpc import aio
from support.worker_server import serve_worker

from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, types_pb2
from services.gateway.http.app import build_app
from services.gateway.relay import Relay
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.model_config import ModelConfig
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.metrics import ServiceMetrics
from tests.gateway.in_memory_store import InMemoryStore, gateway_grpc, gateway_parts

BLOCK = 4
ALICE = (("authorization", "Bearer key-alice"),)
BOB = (("authorization", "Bearer key-bob"),)
PROMPT = "You are a careful assistant. Answer in one short sentence and name your sources. Question:"
ONE_TOKEN = types_pb2.SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass
class Mesh:
    stub: gateway_pb2_grpc.GatewayStub
    http: httpx.AsyncClient
    """The OpenAI routes, as bob."""
    engine: Engine
    model: str
    """The base model's id, as the OpenAI routes name it."""
    reusable: int
    """Prompt tokens of PROMPT a request can take from the cache: its whole blocks but the one
    holding its last token (always computed)."""


@pytest.fixture(scope="module")
def text() -> TokenizerBundle:
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(text) -> LlamaModel:
    """Two random layers of width 64 over SmolLM2's vocabulary, so the gateway's token ids are
    valid (built without transformers, which takes seconds to import)."""
    hidden, inner, kv_dim = 64, 128, 32  # 4 heads of 16, 2 of them for keys and values
    config = ModelConfig.from_hf_config(
        {
            "model_type": "llama", "vocab_size": text.tokenizer.vocab_size, "hidden_size": hidden,
            "intermediate_size": inner, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
        },
        default_name="tiny-smollm-vocab",
    )  # fmt: skip
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (hidden, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, hidden),
            f"{layer}.mlp.gate_proj.weight": (inner, hidden),
            f"{layer}.mlp.up_proj.weight": (inner, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inner),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
        }
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else 0.05 * torch.randn(shape, generator=generator)
        for name, shape in shapes.items()
    }
    return LlamaModel(config, weights, torch.float32)


@pytest.fixture
async def mesh(text, model) -> AsyncIterator[Mesh]:
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, prefix_cache=True))
    engine.start()
    worker_server, worker_address = await serve_worker(engine)

    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        return scheduler_pb2.PlaceResponse(worker_id="w1", address=worker_address)

    channels = ChannelPool()
    parts = gateway_parts(
        "key-alice=alice,key-bob=bob", InMemoryStore(), text, Relay(place, channels, max_resumes=0)
    )
    transport = httpx.ASGITransport(app=build_app(parts, ServiceMetrics("gateway")))
    prompt_tokens = len(text.tokenizer.encode(PROMPT, add_special_tokens=False))
    try:
        async with (
            gateway_grpc(parts) as stub,
            httpx.AsyncClient(
                transport=transport, base_url="http://gateway", headers={"authorization": "Bearer key-bob"}
            ) as http,
        ):
            yield Mesh(stub, http, engine, text.model_name, (prompt_tokens - 1) // BLOCK * BLOCK)
    finally:
        await parts.catalog.stop()
        await channels.close()
        await worker_server.stop(None)
        engine.stop()


async def cached_tokens(mesh: Mesh, who, cache_salt: str = "") -> int:
    """The prompt tokens one generation of PROMPT found cached, from its usage."""
    request = gateway_pb2.GenerateTextRequest(prompt=PROMPT, sampling=ONE_TOKEN, cache_salt=cache_salt)
    replies = [reply async for reply in mesh.stub.Generate(request, metadata=who)]
    return replies[-1].usage.cached_prompt_tokens


async def test_a_prompt_is_shared_within_a_tenant_or_a_salt_and_nowhere_else(mesh):
    assert mesh.reusable >= 4 * BLOCK
    assert await cached_tokens(mesh, ALICE) == 0  # the first: nothing cached yet
    assert await cached_tokens(mesh, BOB) == 0  # alice's blocks are not bob's
    assert await cached_tokens(mesh, ALICE) == mesh.reusable  # but alice's own
    assert await cached_tokens(mesh, BOB) == mesh.reusable  # and bob's own, since he sent it
    assert mesh.engine.prefix_cache.stats().hit_blocks == 2 * mesh.reusable // BLOCK

    assert await cached_tokens(mesh, ALICE, "team-salt") == 0  # a salt is a namespace of its own
    assert await cached_tokens(mesh, BOB, "team-salt") == mesh.reusable  # shared by both who pass it
    assert await cached_tokens(mesh, BOB, "another-salt") == 0
    assert mesh.engine.prefix_cache.stats().hit_blocks == 3 * mesh.reusable // BLOCK


async def test_the_openai_routes_take_cache_salt_and_report_cached_tokens(mesh):
    assert await cached_tokens(mesh, ALICE, "team-salt") == 0
    body = {"model": mesh.model, "prompt": PROMPT, "max_tokens": 1, "cache_salt": "team-salt"}
    for route, extra in (("/v1/completions", {}), ("/v1/completions", {"n": 2})):
        answer = await mesh.http.post(route, json={**body, **extra})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": mesh.reusable}
    unsalted = await mesh.http.post("/v1/completions", json={**body, "cache_salt": None})
    assert unsalted.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # bob's namespace


@pytest.mark.parametrize("salt", ["", "s" * 257, "é" * 129], ids=["empty", "257 bytes", "258 UTF-8 bytes"])
async def test_a_bad_salt_is_a_400_naming_it(mesh, salt):
    body = {"model": mesh.model, "prompt": "Hi", "cache_salt": salt}
    answer = await mesh.http.post("/v1/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "cache_salt", answer.text


async def test_an_over_long_salt_is_invalid_argument_naming_it(mesh):
    with pytest.raises(aio.AioRpcError) as refused:
        await cached_tokens(mesh, ALICE, "s" * 257)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "cache_salt is over 256 bytes; the limit is 256"
