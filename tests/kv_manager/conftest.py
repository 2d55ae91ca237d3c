"""Fixtures of the kv_manager tests: gpu_workers as etcd shows them, and a hang-guarded poll."""

from __future__ import annotations

import pytest
from support.polling import poll_until

from mesh_api.v1.types_pb2 import WorkerLoad
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.etcd.worker_load import worker_load_to_report

TTL_S = 2


@pytest.fixture
def poll():
    return poll_until


class SimulatedWorker:
    """A gpu_worker as etcd shows it: a member key and its WorkerLoad heartbeat.

    ``load`` is the heartbeat; change it and the next write (every ``load_interval_s``) shows it.
    """

    def __init__(self, etcd_endpoint: str, worker_id: str, load: WorkerLoad, load_interval_s: float):
        self.worker_id = worker_id
        self.address = f"127.0.0.1:{50000 + sum(map(ord, worker_id))}"
        self.load = load
        self.registration = MemberRegistration(
            MembershipConfig(etcd_endpoints=etcd_endpoint, ttl_s=TTL_S, load_interval_s=load_interval_s),
            MemberInfo.create("gpu_worker", self.address, instance_id=worker_id),
            load_fn=lambda: worker_load_to_report(self.load),
        )


@pytest.fixture
async def workers(etcd):
    """``await workers("w1", free_blocks=8, ...)`` registers a simulated worker until the test ends."""
    started: list[SimulatedWorker] = []

    async def start(worker_id: str, load_interval_s: float = 0.2, **load) -> SimulatedWorker:
        worker = SimulatedWorker(etcd.endpoint, worker_id, WorkerLoad(**load), load_interval_s)
        await worker.registration.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.registration.stop()
