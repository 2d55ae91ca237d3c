"""A GenerateRequest's ``first_token_deadline_ms`` reaches the engine's batch policy over real
gRPC (tiny random Llama on loopback): the early_abort policy sees it as the request's own
deadline in seconds (0: none, the worker's SLO) and aborts a request that cannot meet it with
DEADLINE_EXCEEDED naming the field; bad values are INVALID_ARGUMENT. Each step is modelled to
take 1 s (a fixed cost model), so no outcome depends on the machine's speed."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc import aio
from support.worker_server import serve_worker

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.model.llama import LlamaModel

SHORT = types_pb2.SamplingParams(max_tokens=2)


class RecordingEarlyAbort(EarlyAbort):
    """Early abort with a 1 s step and a 1000 s SLO, recording each queued request's deadline."""

    def __init__(self):
        super().__init__(
            EarlyAbortConfig(first_token_slo_s=1000.0),
            step_cost_model(FitConfig(min_rows=10**9), LinearCost(STEP_TERMS, (1.0, 0.0, 0.0, 0.0))),
        )
        self.deadlines: dict[str, float | None] = {}

    def plan(self, view: BatchView) -> BatchPlan:
        for request in view.waiting:
            self.deadlines[request.request_id] = request.first_token_deadline_s
        return super().plan(view)


@pytest.fixture
async def worker(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    policy = RecordingEarlyAbort()
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4), batch_policy=policy)
    engine.start()
    server, address = await serve_worker(engine)
    try:
        async with aio.insecure_channel(address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel), policy
    finally:
        await server.stop(None)
        engine.stop()


async def generate(stub, request_id: str, deadline_ms: float) -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=SHORT, first_token_deadline_ms=deadline_ms
    )
    return [reply async for reply in stub.Generate(request)]


async def test_the_engine_sees_the_deadline_in_seconds_and_none_for_zero(worker):
    stub, policy = worker
    assert (await generate(stub, "own", 600_000))[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert (await generate(stub, "none", 0))[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert policy.deadlines == {"own": 600.0, "none": None}


async def test_a_deadline_no_step_can_meet_is_aborted_naming_the_field(worker):
    stub, policy = worker
    with pytest.raises(aio.AioRpcError) as aborted:
        await generate(stub, "hasty", 5)  # 5 ms against a modelled 1 s step
    assert aborted.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "first_token_deadline_ms of 5 ms" in aborted.value.details()
    assert policy.deadlines["hasty"] == 0.005 and policy.aborted == 1


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
async def test_a_bad_deadline_is_invalid_argument(worker, bad):
    stub, policy = worker
    with pytest.raises(aio.AioRpcError) as refused:
        await generate(stub, "bad", bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first_token_deadline_ms" in refused.value.details()
    assert "bad" not in policy.deadlines


def test_the_engine_request_checks_its_deadline():
    assert GenerationRequest("r", (1,), first_token_deadline_s=0.25).first_token_deadline_s == 0.25
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="first_token_deadline_s"):
            GenerationRequest("r", (1,), first_token_deadline_s=bad)
