"""One request's stream from the workers to the client, surviving worker failures.

The gateway asks the scheduler for a worker, streams tokens from it and detokenizes them. When
the worker stream breaks (worker killed, drained, lease lost), it asks for another placement,
excluding the failed worker, and continues there with prompt + tokens so far: dLoRA's "move a
request as tokens, rebuild its state". The client sees one stream; no token is lost or repeated
because only tokens received are counted and the new worker starts right after them. Greedy
output is identical to an uninterrupted run, and so is a seeded sampled one: the workers key
each draw by the seed and the position of the token drawn, not by how many draws came before.

A request may itself start after tokens an earlier stream delivered (a client continuing on
this gateway after another one died): its :class:`~services.gateway.continuation.ResumePoint`
holds them and the detokenizer fed with them, and the relay goes on from there exactly as after
a worker failure.

A migration (issue 16) takes the same path: the scheduler has the worker end the stream with
FINISH_REASON_MIGRATED naming the target, and the relay places the rest there (not as a
failure: the source is not excluded and ``max_resumes`` is not spent).

The first placement carries the prompt text, from which the scheduler may predict the output
length (Magnus); the prediction goes to the worker (HRRN orders its queue by it) and the real
length goes back to the scheduler when the request ends, for the predictor to learn from.

The request's first-token deadline goes to the scheduler (admission) and, less the time already
spent since the request arrived here, to the worker, whose ``early_abort`` policy holds the
request to it. Once a token was delivered the deadline is behind it: later placements carry none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from mesh_api.v1 import gateway_pb2, scheduler_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.continuation import ResumePoint
from services.runtime.errors import Unavailable
from services.runtime.etcd.discovery import ChannelPool

log = logging.getLogger("loramesh.gateway")

Place = Callable[[scheduler_pb2.PlaceRequest], Awaitable[scheduler_pb2.PlaceResponse]]
ReportCompletion = Callable[[scheduler_pb2.ReportCompletionRequest], Awaitable[object]]

#: Worker failures that mean "this worker is gone", not "this request is bad".
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})  # fmt: skip

MIN_WORKER_DEADLINE_MS = 1.0
"""The first-token deadline sent to a worker once the request's is spent (0 would mean none)."""


class WorkerFailed(Exception):
    """The worker ended the stream with FINISH_REASON_ERROR."""


@dataclass(frozen=True)
class RelayRequest:
    request_id: str
    prompt_ids: list[int]
    adapter_id: str
    sampling: types_pb2.SamplingParams
    """With ``max_tokens`` already resolved."""
    first_token_deadline_ms: float
    """Milliseconds from its arrival here to its first token; 0: none (the worker's own SLO)."""
    start: ResumePoint
    """Where the generation starts: nothing generated yet, or the tokens a client was
    delivered by an earlier stream (consumed by the relay)."""
    prompt_text: str = ""
    """The prompt as text, for the scheduler's length predictor ("": none)."""
    prefix_cache_namespace: str = ""
    """Whose cached prompt KV it may share on the workers
    (:mod:`services.gateway.prefix_cache_namespace`)."""
    prefix_blocks: tuple[bytes, ...] = ()
    """The prompt's whole blocks as the workers' prefix caches name them, for prefix-aware
    placement (:func:`services.gateway.prefix_blocks.placement_prefix_blocks`); (): none."""
    prefix_block_tokens: int = 0
    """Tokens in each of ``prefix_blocks``."""


@dataclass
class _Progress:
    """One request's progress over its placements."""

    request: RelayRequest
    started: float
    """When the relay began, on its clock."""
    generated: list[int]
    """Every token generated so far, those of ``request.start`` included."""
    excluded: list[str] = field(default_factory=list)
    """The workers that failed it, not to be placed on again."""
    first_token_ms: float | None = None
    resumes: int = 0
    """Placements after a worker failure."""
    migrations: int = 0
    """Placements after a migration."""
    predicted: int = 0
    """The scheduler's predicted output length at the first placement (0: none)."""
    prefer: str = ""
    """The worker a migration named, for the next placement."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the latest worker to send tokens found in its prefix cache."""
    finished: bool = False

    @property
    def placements(self) -> int:
        """Placements before the next one."""
        return self.resumes + self.migrations


class Relay:
    def __init__(
        self,
        place: Place,
        channels: ChannelPool,
        max_resumes: int,
        report_completion: ReportCompletion | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``clock``: monotonic seconds, for the usage's timings and the deadline left."""
        self._clock = clock
        self._place = place
        self._report_completion = report_completion
        self._reports: set[asyncio.Task] = set()
        self._channels = channels
        self._max_resumes = max_resumes

    async def stream(
        self, request: RelayRequest, on_timings: Callable[[types_pb2.Timings], None] | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateTextResponse]:
        """``on_timings``: told the timings each worker reports at the end of its stream."""
        run = _Progress(request, started=self._clock(), generated=list(request.start.generated))
        if request.start.finished:  # a continuation of a generation that had already ended
            yield gateway_pb2.GenerateTextResponse(
                finish_reason=request.start.finished, request_id=request.request_id, usage=self._usage(run)
            )
            return
        while True:
            placement = await self._place_next(run)
            call = self._generate(run, placement)
            try:
                async for reply in call:
                    if on_timings is not None and reply.HasField("timings"):
                        on_timings(reply.timings)
                    if reply.finish_reason == types_pb2.FINISH_REASON_ERROR:
                        raise WorkerFailed(placement.worker_id)
                    if reply.finish_reason == types_pb2.FINISH_REASON_MIGRATED:
                        run.migrations += 1
                        run.prefer = reply.migrated_to
                        break
                    response = self._relay_reply(run, reply, call)
                    if response is not None:
                        yield response
                    if run.finished:
                        return
            except (grpc.RpcError, WorkerFailed) as error:
                self._count_failure(run, placement, error)
            finally:
                # A client that goes away (cancellation, a closed generator) cancels the worker's
                # request too, which frees its pages there at once.
                call.cancel()

    async def _place_next(self, run: _Progress) -> scheduler_pb2.PlaceResponse:
        """A worker for the rest of the request; the first placement's length prediction is kept."""
        request, generated = run.request, run.generated
        placement = await self._place(
            scheduler_pb2.PlaceRequest(
                request_id=request.request_id,
                adapter_id=request.adapter_id,
                prompt_tokens=len(request.prompt_ids) + len(generated),
                max_tokens=request.sampling.max_tokens - len(generated),
                first_token_deadline_ms=request.first_token_deadline_ms if not generated else 0.0,
                exclude_workers=run.excluded,
                prompt_text=request.prompt_text if not run.placements else "",
                prefer_worker=run.prefer,
                prefix_blocks=request.prefix_blocks,
                prefix_block_tokens=request.prefix_block_tokens,
            )
        )
        if not run.placements:
            run.predicted = placement.predicted_output_tokens
        return placement

    def _generate(self, run: _Progress, placement: scheduler_pb2.PlaceResponse) -> grpc.aio.UnaryStreamCall:
        """The worker's stream of the rest: the prompt and the tokens so far, the tokens left."""
        request, generated = run.request, run.generated
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = request.sampling.max_tokens - len(generated)
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(placement.address))
        return stub.Generate(
            worker_pb2.GenerateRequest(
                request_id=f"{request.request_id}.{run.placements}",
                prompt_token_ids=[*request.prompt_ids, *generated],
                adapter_id=request.adapter_id,
                sampling=sampling,
                predicted_output_tokens=max(1, run.predicted - len(generated)) if run.predicted else 0,
                first_token_deadline_ms=0.0 if generated else self._deadline_left_ms(request, run.started),
                resumed_output_tokens=len(generated),
                prefix_cache_namespace=request.prefix_cache_namespace,
            )
        )

    def _relay_reply(
        self, run: _Progress, reply: worker_pb2.GenerateResponse, call: grpc.aio.UnaryStreamCall
    ) -> gateway_pb2.GenerateTextResponse | None:
        """The client's message for a worker's reply (None: nothing to say); the last one, with
        the usage, when the generation ends (``run.finished``)."""
        ids = list(reply.token_ids)
        if ids and run.first_token_ms is None:
            run.first_token_ms = (self._clock() - run.started) * 1000
        run.generated += ids
        if ids:
            run.cached_prompt_tokens = reply.cached_prompt_tokens
        detok, request_id = run.request.start.detokenizer, run.request.request_id
        finish = reply.finish_reason
        ended_by_token = (
            finish == types_pb2.FINISH_REASON_STOP and ids and ids[-1] in run.request.start.stop_ids
        )
        text = detok.add(ids[:-1] if ended_by_token else ids)
        if detok.stopped:
            call.cancel()
            finish = types_pb2.FINISH_REASON_STOP
        if finish:
            text += detok.flush()
            run.finished = True
            self._report(request_id, len(run.generated))
            return gateway_pb2.GenerateTextResponse(
                text=text,
                token_ids=ids,
                logprobs=reply.logprobs,
                finish_reason=finish,
                request_id=request_id,
                usage=self._usage(run),
            )
        if ids:
            return gateway_pb2.GenerateTextResponse(
                text=text, token_ids=ids, logprobs=reply.logprobs, request_id=request_id
            )
        return None

    def _count_failure(
        self, run: _Progress, placement: scheduler_pb2.PlaceResponse, error: grpc.RpcError | WorkerFailed
    ) -> None:
        """A resumable failure excludes its worker from the next placement; any other, or one
        past ``max_resumes``, ends the request."""
        if isinstance(error, grpc.RpcError) and error.code() not in RESUMABLE:
            raise error
        if run.resumes >= self._max_resumes:
            raise Unavailable(
                f"request {run.request.request_id} failed on {run.resumes + 1} workers; "
                f"last: {placement.worker_id}"
            ) from None
        run.resumes += 1
        run.prefer = ""
        run.excluded.append(placement.worker_id)

    def _usage(self, run: _Progress) -> gateway_pb2.Usage:
        return gateway_pb2.Usage(
            prompt_tokens=len(run.request.prompt_ids),
            completion_tokens=len(run.generated),
            first_token_ms=run.first_token_ms or 0.0,
            total_ms=(self._clock() - run.started) * 1000,
            resumes=run.resumes,
            migrations=run.migrations,
            # A worker resuming it counts the tokens generated before as prompt: not the client's.
            cached_prompt_tokens=min(run.cached_prompt_tokens, len(run.request.prompt_ids)),
        )

    def _deadline_left_ms(self, request: RelayRequest, started: float) -> float:
        """What is left of the request's first-token deadline now (0: it has none). A deadline
        already past is sent as :data:`MIN_WORKER_DEADLINE_MS`, not 0 (which means "none")."""
        if not request.first_token_deadline_ms:
            return 0.0
        left = request.first_token_deadline_ms - (self._clock() - started) * 1000
        return max(left, MIN_WORKER_DEADLINE_MS)

    def _report(self, request_id: str, generated_tokens: int) -> None:
        """Tell the scheduler the request's real length, without delaying its last reply."""
        if self._report_completion is None:
            return
        message = scheduler_pb2.ReportCompletionRequest(
            request_id=request_id, generated_tokens=generated_tokens
        )
        task = asyncio.get_running_loop().create_task(self._send_report(message))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _send_report(self, message: scheduler_pb2.ReportCompletionRequest) -> None:
        try:
            await self._report_completion(message)
        except Exception as error:  # noqa: BLE001 - only the predictor's learning is lost
            log.info("could not report completion of %s: %s", message.request_id, error)
