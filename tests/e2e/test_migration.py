"""Migration between real processes (issue 16): a request moved mid-generation from one worker to
another by the scheduler finishes with the greedy output of a run that never moved; the adapter
moves with it; and a scheduler with ``--migration co-migration`` moves queued requests off an
overloaded worker by itself."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from support.mesh import start_mesh, wait_for_workers
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient
from mesh_api.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.security.tls import aio_channel

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
MAX_TOKENS = 160
"""Long enough that the move (a listing, an adapter load and a hand-off, each a step or so)
lands mid-generation: the request cannot end before it on any machine, fast or slow."""


async def adapters_held_at(mesh, address: str) -> list[str]:
    async with aio_channel(address, mesh.operator_tls) as channel:
        listed = await worker_pb2_grpc.WorkerStub(channel).ListRequests(worker_pb2.ListRequestsRequest())
    return list(listed.held_adapters)


async def test_a_request_migrated_mid_generation_finishes_as_if_it_never_moved(mesh, base_spec, tmp_path):
    directory = write_peft_adapter(
        tmp_path / "storyteller",
        base_spec,
        SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, scale=0.04, seed=7),
    )
    async with (
        AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as client,
        aio_channel(mesh.scheduler.address, mesh.operator_tls) as channel,
    ):
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        adapter = await client.adapters.upload(directory, "storyteller")
        unmoved = await client.generate(PROMPT, adapter="storyteller", max_tokens=MAX_TOKENS, ignore_eos=True)
        assert unmoved.usage.migrations == 0

        tokens, usage, moved = [], None, None
        async for delta in client.stream(
            PROMPT, adapter="storyteller", max_tokens=MAX_TOKENS, ignore_eos=True
        ):
            tokens += delta.token_ids
            if moved is None and len(tokens) >= 4:
                moved = await scheduler.Migrate(scheduler_pb2.MigrateRequest(request_id=delta.request_id))
            usage = delta.usage or usage
        view = await scheduler.ClusterView(scheduler_pb2.ClusterViewRequest())

    assert tokens == list(unmoved.token_ids)
    assert len(tokens) == MAX_TOKENS
    assert (usage.migrations, usage.resumes) == (1, 0)
    assert moved.source_worker_id != moved.target_worker_id
    assert moved.worker_request_id.startswith(delta.request_id)
    assert view.activity.migrations == 1
    target = next(w.address for w in view.workers if w.worker_id == moved.target_worker_id)
    assert adapter.id in await adapters_held_at(mesh, target)  # the adapter moved with the request


async def test_migrating_an_unknown_request_is_not_found_and_changes_nothing(mesh):
    async with aio_channel(mesh.scheduler.address, mesh.operator_tls) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await scheduler.Migrate(scheduler_pb2.MigrateRequest(request_id="no-such-request"))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-request" in raised.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await scheduler.Migrate(scheduler_pb2.MigrateRequest())
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        view = await scheduler.ClusterView(scheduler_pb2.ClusterViewRequest())
    assert view.activity.migrations == 0 and view.activity.migration_failures == 0


async def test_co_migration_moves_queued_requests_off_an_overloaded_worker(base_spec, tmp_path):
    """worker-0 runs one request at a time and gets six that never end on their own; worker-1 is
    idle. The queued ones wait there until the scheduler's co-migration round (queue delay over
    its 1 s trigger) loads their adapter on worker-1 and hands them off: nothing here races the
    clock, the requests would wait forever otherwise."""
    mesh = await start_mesh(
        tmp_path, scheduler_flags=("--migration", "co-migration"), worker_flags=("--max-running", "1")
    )
    try:
        await wait_for_workers(mesh, 2)
        directory = write_peft_adapter(
            tmp_path / "busy", base_spec, SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, seed=3)
        )
        async with AsyncClient(mesh.gateway.address, "key-alice") as client:
            adapter = await client.adapters.upload(directory, "busy")
        ended: asyncio.Queue[worker_pb2.GenerateResponse] = asyncio.Queue()

        async def generate(worker, i: int) -> None:
            request = worker_pb2.GenerateRequest(
                request_id=f"direct-{i}",
                prompt_token_ids=[1, 504, 3458, 314, 2365 + i],
                adapter_id=adapter.id,
                sampling=types_pb2.SamplingParams(max_tokens=4000, ignore_eos=True),
            )
            async for reply in worker.Generate(request):
                if reply.finish_reason:
                    await ended.put(reply)

        async with (
            aio_channel(mesh.workers[0].address, mesh.operator_tls) as channel,
            aio_channel(mesh.scheduler.address, mesh.operator_tls) as scheduler_channel,
        ):
            worker = worker_pb2_grpc.WorkerStub(channel)
            streams = [asyncio.create_task(generate(worker, i)) for i in range(6)]
            first = await asyncio.wait_for(ended.get(), timeout=300)  # hang guard only
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
            # The scheduler counts a migration once its HandOff call returns, which may be just
            # after the handed-off stream ended here: wait for the count, not a moment.
            view = await poll_until(
                lambda: scheduler.ClusterView(scheduler_pb2.ClusterViewRequest()),
                lambda view: view.activity.migrations >= 1,
                "the scheduler counts the migration",
            )
    finally:
        mesh.stop()
    assert first.finish_reason == types_pb2.FINISH_REASON_MIGRATED
    assert first.migrated_to == "worker-1"
    assert view.activity.migration_policy == "co-migration"
    assert view.activity.migrations >= 1 and view.activity.rebalance_rounds >= 1
