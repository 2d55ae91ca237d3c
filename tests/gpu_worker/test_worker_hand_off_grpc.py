"""The worker's migration RPCs over real gRPC (tiny random Llama on loopback): ListRequests shows
what runs and waits, HandOff ends a stream with MIGRATED naming the target after every token
already sent, and bad or late calls get a clear status while other requests go on."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc import aio
from support.worker_server import serve_worker

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel

LONG = types_pb2.SamplingParams(max_tokens=100_000, ignore_eos=True)
"""Never ends on its own within the tiny model's context: only a hand-off or a cancel ends it."""


@pytest.fixture
async def worker(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=1))
    engine.start()
    server, address = await serve_worker(engine)
    try:
        async with aio.insecure_channel(address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        await server.stop(None)
        engine.stop()


async def test_a_handed_off_stream_ends_migrated_after_its_tokens_and_the_queue_goes_on(worker):
    running = worker.Generate(
        worker_pb2.GenerateRequest(request_id="a.0", prompt_token_ids=[1, 2, 3], sampling=LONG)
    )
    tokens = []
    async for reply in running:
        tokens += reply.token_ids
        if len(tokens) >= 3:
            break
    queued = worker.Generate(
        worker_pb2.GenerateRequest(
            request_id="b.0", prompt_token_ids=[4, 5], sampling=types_pb2.SamplingParams(max_tokens=4)
        )
    )
    listed = await worker.ListRequests(worker_pb2.ListRequestsRequest())
    by_id = {r.request_id: r for r in listed.requests}
    assert by_id["a.0"].running and by_id["a.0"].context_tokens >= 3 + 3
    assert listed.max_running == 1 and 0 < listed.free_tokens < listed.memory_tokens

    handed = await worker.HandOff(worker_pb2.HandOffRequest(request_id="a.0", target_worker_id="w9"))
    async for reply in running:
        tokens += reply.token_ids
        last = reply
    assert last.finish_reason == types_pb2.FINISH_REASON_MIGRATED and last.migrated_to == "w9"
    assert len(tokens) == handed.generated_tokens
    finished = [reply async for reply in queued][-1]  # the queued request got the slot
    assert finished.finish_reason == types_pb2.FINISH_REASON_LENGTH


async def test_bad_and_late_hand_offs_are_refused_clearly(worker):
    for request, code, words in [
        (worker_pb2.HandOffRequest(target_worker_id="w9"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (worker_pb2.HandOffRequest(request_id="x"), grpc.StatusCode.INVALID_ARGUMENT, "target_worker_id"),
        (
            worker_pb2.HandOffRequest(request_id="gone", target_worker_id="w9"),
            grpc.StatusCode.NOT_FOUND,
            "gone",
        ),
    ]:
        with pytest.raises(aio.AioRpcError) as refused:
            await worker.HandOff(request)
        assert refused.value.code() == code and words in refused.value.details()
    done = [
        r async for r in worker.Generate(worker_pb2.GenerateRequest(request_id="d", prompt_token_ids=[1]))
    ]
    assert done[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert (await worker.ListRequests(worker_pb2.ListRequestsRequest())).requests == []
