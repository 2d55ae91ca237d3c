"""Magnus' predictor through the live mesh: the gateway sends each prompt to the scheduler and
reports each real length back; after its first completions the scheduler fits its forest,
predicts the next requests (which the workers' ``hrrn`` policy orders by) and measures its error."""

from __future__ import annotations

import asyncio

import pytest
from support.mesh import start_mesh, wait_for_workers

from loramesh import AsyncClient
from mesh_api.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.runtime.security.tls import aio_channel

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPTS = ["Say hi.", "Name one colour.", "Write a poem about the sea.", "Count from one to ten."]
MAX_ROUNDS = 100
"""Hang guard only: the scheduler fits its first forest in the background (loading MiniLM takes
a few seconds); each round sends one more request and looks again."""


async def test_the_scheduler_learns_lengths_from_the_mesh_and_predicts_them(tmp_path):
    mesh = await start_mesh(
        tmp_path,
        scheduler_flags=("--length-predictor", "magnus", "--predictor-bootstrap-completions", "4"),
        worker_flags=("--batch-policy", "hrrn"),
    )
    try:
        await wait_for_workers(mesh, 2)
        async with (
            AsyncClient(mesh.gateway.address, "key-alice") as client,
            aio_channel(mesh.scheduler.address, mesh.operator_tls) as channel,
        ):
            scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
            answers = await asyncio.gather(*(client.generate(p, max_tokens=24) for p in PROMPTS))
            assert all(a.usage.completion_tokens > 0 for a in answers)
            for i in range(MAX_ROUNDS):
                activity = (await scheduler.ClusterView(scheduler_pb2.ClusterViewRequest())).activity
                if activity.completions_observed >= 1:
                    break
                await client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=24)
            else:
                raise AssertionError(
                    f"the scheduler never compared a prediction with a completion: {activity}"
                )
    finally:
        mesh.stop()
    assert activity.length_predictor == "magnus"
    assert activity.predictions >= activity.completions_observed >= 1
