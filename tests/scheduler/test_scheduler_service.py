"""The scheduler as an operator runs it: a real process following a real etcd.

The gpu_workers are simulated: each is a real etcd registration (member key + load reports in the
gpu_worker format, from a dict the test changes), which is all the scheduler ever sees of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import pytest
from grpc import aio

from mesh_api.v1 import scheduler_pb2 as pb
from mesh_api.v1 import scheduler_pb2_grpc
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig, read_loads
from services.runtime.process.process import ServiceProcess, ServiceStartError

pytestmark = pytest.mark.integration

T = TypeVar("T")
TTL_S = 2
HANG_GUARD_S = 60.0  # not a timing claim: only keeps a broken build from hanging the suite
RPC_TIMEOUT_S = HANG_GUARD_S  # a deadline on each call, also only against hangs


class SimulatedWorker:
    """A gpu_worker as etcd shows it: a member key and a load report refreshed every 0.2 s."""

    def __init__(self, etcd_endpoint: str, worker_id: str, **report: Any):
        self.worker_id = worker_id
        self.address = f"127.0.0.1:{50000 + int(worker_id[1:])}"
        self.report: dict[str, Any] = {
            "queue": 0, "running": 0, "free_pages": 100, "total_pages": 200, "kv_pages": 50,
            "adapter_pages": 50, "resident_adapters": [], "tokens_per_s": 128.0, "preemptions": 0,
            "fragmentation": 0.0,
        }  # fmt: skip
        self.report.update(report)
        self.registration = MemberRegistration(
            MembershipConfig(etcd_endpoints=etcd_endpoint, ttl_s=TTL_S, load_interval_s=0.2),
            MemberInfo.create("gpu_worker", self.address, instance_id=worker_id),
            load_fn=lambda: dict(self.report),
        )


@pytest.fixture
async def workers(etcd):
    started: list[SimulatedWorker] = []

    async def start(worker_id: str, **report: Any) -> SimulatedWorker:
        worker = SimulatedWorker(etcd.endpoint, worker_id, **report)
        await worker.registration.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.registration.stop()


@pytest.fixture
async def scheduler(etcd, tmp_path):
    processes: list[ServiceProcess] = []
    channels: list[aio.Channel] = []

    async def start(*flags: str) -> scheduler_pb2_grpc.SchedulerStub:
        args = ["--etcd-endpoints", etcd.endpoint, "--lease-ttl-s", str(TTL_S), "--grace-s", "1", *flags]
        proc = ServiceProcess("scheduler", args, log_path=tmp_path / f"scheduler{len(processes)}.log")
        processes.append(proc.start())
        await proc.wait_ready(30)
        channels.append(aio.insecure_channel(proc.address))
        return scheduler_pb2_grpc.SchedulerStub(channels[-1])

    yield start
    for channel in channels:
        await channel.close()
    for proc in processes:
        proc.kill()


async def poll(fetch: Callable[[], Awaitable[T]], predicate: Callable[[T], bool], what: str) -> T:
    end = time.monotonic() + HANG_GUARD_S
    while True:
        value = await fetch()
        if predicate(value):
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not true after {HANG_GUARD_S:.0f}s; last value {value!r}")
        await asyncio.sleep(0.05)


async def view(stub) -> dict[str, pb.WorkerView]:
    reply = await stub.ClusterView(pb.ClusterViewRequest(), timeout=RPC_TIMEOUT_S)
    return {w.worker_id: w for w in reply.workers}


async def place(stub, **request: Any) -> pb.PlaceResponse:
    return await stub.Place(pb.PlaceRequest(**request), timeout=RPC_TIMEOUT_S)


async def refused(stub, **request: Any) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as err:
        await place(stub, **request)
    return err.value


def retry_after(error: aio.AioRpcError) -> float:
    values = [v for k, v in (error.trailing_metadata() or ()) if k == "retry-after-s"]
    assert values, f"no retry-after-s in {error.trailing_metadata()!r}"
    return float(values[0])


async def test_place_prefers_the_resident_adapter_then_the_shorter_queue(scheduler, workers, etcd):
    stub = await scheduler()
    w1 = await workers("w1", resident_adapters=["sql"])
    w2 = await workers("w2")
    current = await poll(
        lambda: view(stub),
        lambda v: "sql" in getattr(v.get("w1"), "resident_adapters", []) and "w2" in v,
        "both workers listed",
    )
    assert current["w1"].address == w1.address and current["w2"].total_pages == 200

    chosen = await place(stub, request_id="r1", adapter_id="sql")
    assert (chosen.worker_id, chosen.address, chosen.adapter_resident) == ("w1", w1.address, True)
    assert chosen.estimated_wait_ms == 0

    # w1 now has 5 queued (5 s at 128 tokens/s): loading sql on w2 (50 ms) is quicker.
    w1.report["queue"] = 5
    w2.report["resident_adapters"] = ["chat"]
    await poll(
        lambda: view(stub),
        lambda v: v["w1"].queue == 5 and list(v["w2"].resident_adapters) == ["chat"],
        "new reports",
    )
    chosen = await place(stub, adapter_id="sql")
    assert (chosen.worker_id, chosen.adapter_resident) == ("w2", False)
    assert chosen.estimated_wait_ms == pytest.approx(50)
    assert (await place(stub, adapter_id="chat")).worker_id == "w2"
    assert (await place(stub, adapter_id="sql", exclude_workers=["w2"])).worker_id == "w1"

    # The scheduler's own load report (in etcd, like every member's) counts workers and placements.
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    loads = await poll(
        lambda: read_loads(config),
        lambda r: any(v.get("placements") == 4 for v in r.values()),
        "scheduler load report",
    )
    assert any(v.get("workers") == 2 and v.get("placements") == 4 for v in loads.values())


async def test_full_queues_and_missed_deadlines_are_refused_at_once_with_retry_after(scheduler, workers):
    stub = await scheduler("--max-queue-per-worker", "4")
    await workers("w1", queue=4)
    w2 = await workers("w2", queue=6, tokens_per_s=256.0)
    await poll(lambda: view(stub), lambda v: len(v) == 2 and v["w2"].queue == 6, "both workers listed")

    error = await refused(stub, adapter_id="sql")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in error.details() and "bound of 4" in error.details()
    assert retry_after(error) == pytest.approx(1.0)  # w1: one completion at 1 s each

    w2.report["queue"] = 1  # 1 ahead at 0.5 s each
    await poll(lambda: view(stub), lambda v: v["w2"].queue == 1, "w2 drained")
    error = await refused(stub, first_token_deadline_ms=100)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "deadline of 100 ms" in error.details() and "on w2" in error.details()
    assert retry_after(error) > 0
    chosen = await place(stub, first_token_deadline_ms=2000)
    assert chosen.worker_id == "w2" and chosen.estimated_wait_ms == pytest.approx(500)


async def test_no_worker_is_unavailable_and_departed_workers_leave_the_view(scheduler, workers):
    stub = await scheduler()
    assert (await view(stub)) == {}
    error = await refused(stub, adapter_id="sql")
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "no gpu_worker is live" in error.details()

    w1 = await workers("w1")
    w2 = await workers("w2")
    await poll(lambda: view(stub), lambda v: set(v) == {"w1", "w2"}, "both workers listed")
    error = await refused(stub, exclude_workers=["w1", "w2"])
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "excluded" in error.details()

    await w1.registration.stop()  # graceful: lease revoked, gone at once
    await poll(lambda: view(stub), lambda v: set(v) == {"w2"}, "w1 gone")
    assert (await place(stub)).worker_id == "w2"
    await w2.registration.abandon()  # crashed: gone when its lease expires
    await poll(lambda: view(stub), lambda v: not v, "w2 gone after its TTL")
    assert (await refused(stub)).code() == grpc.StatusCode.UNAVAILABLE


async def test_scheduler_without_etcd_fails_clearly(tmp_path):
    proc = ServiceProcess("scheduler", [], log_path=tmp_path / "scheduler.log").start()
    try:
        with pytest.raises(ServiceStartError, match="--etcd-endpoints"):
            await proc.wait_ready(30)
        assert proc.proc.returncode != 0
    finally:
        proc.kill()


async def test_replicas_rebuild_the_same_view_from_etcd_and_place_alike(scheduler, workers):
    """Why the scheduler runs as stateless replicas (docs/operations.md): everything it decides
    on comes from etcd, so a replica started at any time decides as the others do."""
    first = await scheduler()
    await workers("w1", resident_adapters=["sql"], queue=1)
    await workers("w2", queue=3)
    second = await scheduler()
    for stub in (first, second):
        await poll(
            lambda stub=stub: view(stub),
            lambda v: (
                v.keys() == {"w1", "w2"} and v["w2"].queue == 3 and list(v["w1"].resident_adapters) == ["sql"]
            ),
            "both workers and their reports listed",
        )
    placed = [
        await place(stub, adapter_id=adapter) for adapter in ("sql", "chat") for stub in (first, second)
    ]
    assert [(p.worker_id, p.adapter_resident) for p in placed] == [("w1", True)] * 2 + [("w1", False)] * 2


async def test_prefix_aware_placement_follows_the_blocks_it_placed(scheduler, workers):
    """Two idle workers; each prompt goes back where its 2,000-token prefix was placed (2 s of
    prefill saved at the default 1 ms a token outweighs the ≤ 1.06 s that a placement not yet in a
    report adds), whoever else asks, and a placement naming blocks without their size is refused."""
    stub = await scheduler("--placement", "prefix-aware")
    await workers("w1")
    await workers("w2")
    await poll(lambda: view(stub), lambda v: {"w1", "w2"} <= v.keys(), "both workers listed")
    first = [bytes([1, i]) * 16 for i in range(125)]
    second = [bytes([2, i]) * 16 for i in range(125)]
    prompt = {"prompt_tokens": 2010, "prefix_block_tokens": 16}
    assert (await place(stub, prefix_blocks=first, **prompt)).worker_id == "w1"  # a tie: smaller id
    assert (await place(stub, prefix_blocks=second, exclude_workers=["w1"], **prompt)).worker_id == "w2"
    for blocks, holder in ((second, "w2"), (first, "w1"), (second[:100], "w2")):
        assert (await place(stub, adapter_id="sql", prefix_blocks=blocks, **prompt)).worker_id == holder
    error = await refused(stub, prefix_blocks=first, prompt_tokens=2010)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix_block_tokens must be >= 1" in error.details()
