"""One request to one worker over its real gRPC API, recorded as a :class:`RequestOutcome`."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc import aio

from bench.distkv.outcome import RequestOutcome
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc

STUCK_POLLS = 5
"""A probe is stuck when this many Stats polls in a row, a second apart, see its idle worker run
nothing while a request waits: the engine only retries a request it cannot fit, so nothing
changes until it is cancelled (preempt: the request outgrew the pool; borrow: no lender has
enough blocks)."""
REFUSED_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
"""Statuses a worker answers at once for a request it can never serve."""


class WorkerClient:
    """A channel to one worker, reused by every request sent to it."""

    def __init__(self, address: str):
        self.address = address
        self._channel = aio.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def stats(self) -> worker_pb2.WorkerStatsResponse:
        return await self.stub.Stats(worker_pb2.WorkerStatsRequest())

    async def generate(
        self, outcome: RequestOutcome, prompt: list[int], new_tokens: int, clock_zero: float
    ) -> RequestOutcome:
        """Send it, record every token's arrival; fills and returns ``outcome``."""
        request = worker_pb2.GenerateRequest(
            request_id=outcome.request_id,
            prompt_token_ids=prompt,
            sampling=types_pb2.SamplingParams(max_tokens=new_tokens, ignore_eos=True),
        )
        outcome.started_s = time.monotonic() - clock_zero
        try:
            async for reply in self.stub.Generate(request):
                now = time.monotonic() - clock_zero
                for _ in reply.token_ids:
                    outcome.token_times_s.append(now)
                if outcome.first_token_s is None and reply.token_ids:
                    outcome.first_token_s = now
                if reply.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED:
                    outcome.preemptions = reply.timings.preemptions
                    if reply.finish_reason != types_pb2.FINISH_REASON_LENGTH:
                        outcome.status = "failed"
                        outcome.detail = types_pb2.FinishReason.Name(reply.finish_reason)
        except aio.AioRpcError as error:
            code = error.code()
            outcome.status = "refused" if code in REFUSED_CODES and not outcome.token_times_s else "failed"
            outcome.detail = f"{code.name}: {error.details()}"
        outcome.output_tokens = len(outcome.token_times_s)
        if outcome.status == "completed" and outcome.output_tokens != new_tokens:
            outcome.status, outcome.detail = "failed", f"{outcome.output_tokens} of {new_tokens} tokens"
        outcome.finished_s = time.monotonic() - clock_zero
        return outcome

    async def generate_or_detect_stuck(
        self, outcome: RequestOutcome, prompt: list[int], new_tokens: int, clock_zero: float
    ) -> RequestOutcome:
        """:meth:`generate` for a request sent to an otherwise idle worker, cancelled as
        ``stuck`` when the worker shows it can never start it (see ``STUCK_POLLS``)."""
        generation = asyncio.ensure_future(self.generate(outcome, prompt, new_tokens, clock_zero))
        idle_polls = 0
        while not generation.done():
            await asyncio.wait({generation}, timeout=1.0)
            if generation.done():
                break
            stats = await self.stats()
            idle = stats.running == 0 and stats.queue >= 1 and not outcome.token_times_s
            idle_polls = idle_polls + 1 if idle else 0
            if idle_polls >= STUCK_POLLS:
                generation.cancel()
                try:
                    await generation
                except asyncio.CancelledError:
                    pass
                outcome.status = "stuck"
                outcome.detail = f"queued but never run ({stats.queue} waiting, nothing running)"
                outcome.output_tokens = len(outcome.token_times_s)
                outcome.finished_s = time.monotonic() - clock_zero
                return outcome
        return generation.result()
