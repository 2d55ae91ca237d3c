"""A gpu_worker cut off from etcd (a partition between it and a real etcd: tests/support/tcp_link.py)
refuses new requests and new loans with UNAVAILABLE naming etcd before its lease can expire
elsewhere, finishes the stream it was running, and serves again once it is registered again.
Real gRPC on loopback, a tiny random Llama; the fence's clock is injected, so the test moves it
past the fence instead of waiting for real time."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc import aio
from support.polling import HANG_GUARD_S, poll_until
from support.tcp_link import TcpLink
from support.worker_server import serve_worker

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig

pytestmark = pytest.mark.integration

RUNNING_TOKENS = 200
"""Tokens of the stream in flight when the fence goes up: far more than run while it is set up."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def generate(worker: worker_pb2_grpc.WorkerStub, request_id: str) -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6], sampling=types_pb2.SamplingParams(max_tokens=3)
    )
    # The guard only turns a request taken while the engine is held (no fence) into a failure.
    return [reply async for reply in worker.Generate(request, timeout=HANG_GUARD_S)]


async def test_a_worker_cut_off_from_etcd_refuses_new_work_finishes_its_stream_and_comes_back(
    etcd: EtcdServer, tiny_llama
):
    clock = Clock()
    link = await TcpLink(etcd.endpoint).start()
    registration = MemberRegistration(
        MembershipConfig(etcd_endpoints=link.address, ttl_s=2, load_interval_s=0.5),
        MemberInfo.create("gpu_worker", "127.0.0.1:1"),
        clock=clock,
    )
    await registration.start()
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=2))
    engine.start()
    server, address = await serve_worker(engine, fence=registration.fence)
    release = threading.Event()
    try:
        async with aio.insecure_channel(address) as channel:
            worker = worker_pb2_grpc.WorkerStub(channel)
            assert (await generate(worker, "before"))[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH

            running = worker.Generate(
                worker_pb2.GenerateRequest(
                    request_id="running",
                    prompt_token_ids=[1, 2, 3],
                    sampling=types_pb2.SamplingParams(max_tokens=RUNNING_TOKENS, ignore_eos=True),
                )
            )
            tokens = list((await running.read()).token_ids)

            def hold() -> list[str]:
                """Hold the engine between two steps until released; what it runs meanwhile."""
                ids = [summary.request_id for summary in engine.list_requests()]
                release.wait()
                return ids

            held = engine.between_steps(hold)

            link.cut()

            async def registered() -> bool:
                return registration.registered

            await poll_until(registered, lambda yes: not yes, "a keepalive through the cut link failed")
            clock.now += registration.fence.fence_after_s + 0.1

            with pytest.raises(aio.AioRpcError) as refused:
                await generate(worker, "while-cut-off")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (
                "takes no new requests" in refused.value.details() and "lost etcd" in refused.value.details()
            )
            with pytest.raises(aio.AioRpcError) as no_loan:
                await worker.AllocateBlocks(worker_pb2.AllocateBlocksRequest(debtor="w2", count=1))
            assert no_loan.value.code() == grpc.StatusCode.UNAVAILABLE and "etcd" in no_loan.value.details()

            release.set()
            assert held.result(timeout=60) == ["running"]  # it was running when the fence went up
            while (reply := await running.read()) is not aio.EOF:
                tokens += reply.token_ids
                last = reply
            assert last.finish_reason == types_pb2.FINISH_REASON_LENGTH and len(tokens) == RUNNING_TOKENS

            link.heal()

            async def registrations() -> int:
                return registration.registrations

            await poll_until(
                registrations, lambda n: n == 2, "the worker registered again once etcd answered"
            )
            assert registration.fence.problem() == ""
            assert (await generate(worker, "after"))[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    finally:
        release.set()
        await server.stop(None)
        engine.stop()
        await registration.stop()
        await link.close()
