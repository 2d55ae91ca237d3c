"""A workload run as a closed loop: each worker has a fixed number of requests in flight.

Request ``i`` of the workload goes to its worker (``BenchRequest.worker``); each worker's
requests are taken in order by ``concurrency`` client loops, each sending the next one as soon as
its previous one ends. No arrival clock: the load adapts to the configuration's speed, and the
same requests reach the same workers in every configuration.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from bench.distkv.client import WorkerClient
from bench.distkv.outcome import RequestOutcome
from bench.distkv.workload import BenchRequest, prompt_ids


async def run_closed_loop(
    clients: list[WorkerClient],
    requests: list[BenchRequest],
    concurrency: int,
    seed: int,
    hang_guard_s: float,
) -> tuple[list[RequestOutcome], float]:
    """Every request's outcome (in workload order) and the run's wall time. Requests still open
    when ``hang_guard_s`` runs out are cancelled and count as failed."""
    queues = [deque(r for r in requests if r.worker == w) for w in range(len(clients))]
    outcomes = {
        r.request_id: RequestOutcome(r.request_id, r.worker, r.prompt_tokens, r.long) for r in requests
    }
    clock_zero = time.monotonic()

    async def client_loop(worker: int) -> None:
        queue = queues[worker]
        while queue:
            request = queue.popleft()
            prompt = prompt_ids(request.prompt_tokens, seed, request.request_id)
            await clients[worker].generate(
                outcomes[request.request_id], prompt, request.new_tokens, clock_zero
            )

    loops = [
        asyncio.ensure_future(client_loop(worker))
        for worker in range(len(clients))
        for _ in range(concurrency)
    ]
    done, pending = await asyncio.wait(loops, timeout=hang_guard_s)
    for loop in pending:
        loop.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall_s = time.monotonic() - clock_zero
    for loop in done:
        loop.result()  # a bug in the client loop must not pass for a result
    for outcome in outcomes.values():
        if outcome.started_s and not outcome.finished_s:
            outcome.status, outcome.detail = "failed", f"open after the {hang_guard_s:.0f} s hang guard"
            outcome.finished_s = wall_s
        elif not outcome.started_s and not outcome.finished_s:
            outcome.status, outcome.detail = "failed", "never sent: the hang guard ran out first"
    return [outcomes[r.request_id] for r in requests], wall_s
