"""The new sampling fields (penalties, ``min_p``, ``logit_bias``, structured output) through a real
gateway over gRPC: its servicer, core, relay and interceptor on loopback, with the SmolLM2
tokenizer, in front of a worker that records what it is sent. Values out of range are
``INVALID_ARGUMENT`` naming the field before any worker is asked; valid ones reach the worker
as they were sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc import aio

from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.relay import Relay
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from tests.gateway.in_memory_store import InMemoryStore, gateway_grpc, gateway_parts

ALICE = (("authorization", "Bearer key-alice"),)


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    """Records each request and ends it at once with an end-of-sequence token."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.requests: list[worker_pb2.GenerateRequest] = []

    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests.append(request)
        yield worker_pb2.GenerateResponse(
            token_ids=[self.eos_token_id], finish_reason=types_pb2.FINISH_REASON_STOP
        )


@dataclass
class Gateway:
    stub: gateway_pb2_grpc.GatewayStub
    worker: RecordingWorker
    vocab_size: int


@pytest.fixture(scope="module")
def text() -> TokenizerBundle:
    return load_tokenizer()


@pytest.fixture
async def gateway(text) -> AsyncIterator[Gateway]:
    worker = RecordingWorker(text.tokenizer.eos_token_ids[0])
    worker_server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, worker_server)
    worker_address = f"127.0.0.1:{worker_server.add_insecure_port('127.0.0.1:0')}"
    await worker_server.start()

    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        return scheduler_pb2.PlaceResponse(worker_id="recording", address=worker_address)

    channels = ChannelPool()
    parts = gateway_parts("key-alice=alice", InMemoryStore(), text, Relay(place, channels, max_resumes=0))
    try:
        async with gateway_grpc(parts) as stub:
            yield Gateway(stub, worker, text.tokenizer.vocab_size)
    finally:
        await channels.close()
        await worker_server.stop(None)


async def generate(
    gateway: Gateway, sampling: types_pb2.SamplingParams
) -> list[gateway_pb2.GenerateTextResponse]:
    request = gateway_pb2.GenerateTextRequest(prompt="Hi", sampling=sampling)
    return [m async for m in gateway.stub.Generate(request, metadata=ALICE)]


def schema(text: str) -> types_pb2.StructuredOutput:
    return types_pb2.StructuredOutput(json_schema=text)


OUT_OF_RANGE = {
    "presence_penalty": (types_pb2.SamplingParams(presence_penalty=2.5), "presence_penalty"),
    "frequency_penalty": (types_pb2.SamplingParams(frequency_penalty=-3), "frequency_penalty"),
    "min_p": (types_pb2.SamplingParams(min_p=1.5), "min_p"),
    "a logit bias over 100": (types_pb2.SamplingParams(logit_bias={5: 101}), "logit_bias"),
    "too many logit biases": (types_pb2.SamplingParams(logit_bias=dict.fromkeys(range(301), 1.0)), "logit_bias"),
    "a schema that is not JSON": (types_pb2.SamplingParams(structured_output=schema("{")), "response_format"),
    "a schema that is no object": (types_pb2.SamplingParams(structured_output=schema("[1]")), "response_format"),
    "an empty structured output": (
        types_pb2.SamplingParams(structured_output=types_pb2.StructuredOutput()), "response_format",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", OUT_OF_RANGE, ids=list(OUT_OF_RANGE))
async def test_a_value_out_of_range_is_invalid_argument_naming_the_field(gateway, case):
    sampling, field = OUT_OF_RANGE[case]
    with pytest.raises(aio.AioRpcError) as refused:
        await generate(gateway, sampling)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field), refused.value.details()
    assert gateway.worker.requests == []


async def test_a_logit_bias_id_outside_the_vocabulary_is_invalid_argument(gateway):
    with pytest.raises(aio.AioRpcError) as refused:
        await generate(gateway, types_pb2.SamplingParams(logit_bias={gateway.vocab_size: 1}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"logit_bias token ids must be within [0, {gateway.vocab_size})"
    assert gateway.worker.requests == []


async def test_valid_values_reach_the_worker_as_sent(gateway):
    sampling = types_pb2.SamplingParams(
        max_tokens=8,
        presence_penalty=-2,
        frequency_penalty=2,
        min_p=0.25,
        logit_bias={0: -100, gateway.vocab_size - 1: 100},
        structured_output=schema('{"type":"object"}'),
    )
    replies = await generate(gateway, sampling)
    assert replies[-1].finish_reason == types_pb2.FINISH_REASON_STOP
    [request] = gateway.worker.requests
    assert request.sampling == sampling
