"""What the gateway's gRPC API refuses before it costs anything: a chat whose adapter's template is
over the template budget (``FAILED_PRECONDITION`` naming the template and the setting), and a
prompt or chat over ``--max-prompt-bytes`` (``INVALID_ARGUMENT`` naming the field and the
limit, before any of it is tokenized). Through the real servicer and interceptor on loopback;
nothing reaches a worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, types_pb2
from services.gateway.config import GatewayConfig
from services.gateway.relay import Relay
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from tests.gateway.in_memory_store import InMemoryStore, gateway_grpc, gateway_parts

BOB = (("authorization", "Bearer key-bob"),)
LIMIT = GatewayConfig().max_prompt_bytes
LOOPER = types_pb2.AdapterInfo(
    id="b9",
    name="looper",
    owner="bob",
    chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    tool_use_chat_template="{{ 'x' * 10**9 }}",
)
WORDY = types_pb2.AdapterInfo(
    id="b8", name="wordy", owner="bob", chat_template="{{ messages[0].content * 3 }}"
)


@pytest.fixture
async def stub(monkeypatch) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        raise AssertionError("a refused request was placed")

    channels = ChannelPool()
    parts = gateway_parts(
        "key-bob=bob", InMemoryStore([LOOPER, WORDY]), load_tokenizer(), Relay(place, channels, 0)
    )

    def tokenized(*args, **kwargs):
        raise AssertionError("a refused prompt was tokenized")

    monkeypatch.setattr(parts.core, "encode", tokenized)
    try:
        async with gateway_grpc(parts) as served:
            yield served
    finally:
        await channels.close()


async def refusal(call) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as refused:
        [m async for m in call]
    return refused.value


def chat(*contents: str, adapter: str = "") -> gateway_pb2.ChatRequest:
    messages = [gateway_pb2.ChatMessage(role="user", content=c) for c in contents]
    return gateway_pb2.ChatRequest(messages=messages, adapter=adapter)


async def test_a_chat_with_a_template_over_budget_is_failed_precondition_naming_it(stub):
    error = await refusal(stub.Chat(chat("Hi", adapter="looper"), metadata=BOB))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == (
        "the chat template of adapter 'bob/looper' is over the gateway's template budget: "
        "more than 100000 operations (--chat-template-max-operations)"
    )


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (
            lambda stub, text: stub.Generate(gateway_pb2.GenerateTextRequest(prompt=text), metadata=BOB),
            "prompt",
        ),
        (lambda stub, text: stub.Chat(chat(text), metadata=BOB), "messages"),
        (
            lambda stub, text: stub.Chat(chat(text[:10], text[10:], adapter="looper"), metadata=BOB),
            "messages",
        ),
    ],
    ids=["generate", "chat", "chat across messages, before its template"],
)
async def test_a_prompt_over_the_limit_is_invalid_argument_before_it_is_tokenized(stub, call, field):
    error = await refusal(call(stub, "é" * (LIMIT // 2 + 1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"{field} is {LIMIT + 2} bytes; the limit is {LIMIT} (--max-prompt-bytes)"
    huge = await refusal(call(stub, "x" * (3 * 2**20)))  # more characters than bytes allowed: not counted
    assert huge.details() == f"{field} is over {LIMIT} bytes; the limit is {LIMIT} (--max-prompt-bytes)"


async def test_a_chat_its_template_lays_out_over_the_limit_is_refused_before_it_is_tokenized(stub):
    error = await refusal(stub.Chat(chat("é" * (LIMIT // 4), adapter="wordy"), metadata=BOB))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"messages, as the chat template of adapter 'bob/wordy' lays them out, are {LIMIT // 2 * 3} bytes; "
        f"the limit is {LIMIT} (--max-prompt-bytes)"
    )
