"""``loramesh.v1.Worker``: proto <-> engine. The engine runs on its own thread; its events reach
this event loop through ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import collections
import functools
import uuid

from grpc import aio

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.distkv import SharedLender
from services.gpu_worker.distkv.transport.lending_lane import LaneServer
from services.gpu_worker.distkv.transport.lending_proto import (
    answer_attend_remote,
    apply_write_kv,
    layout_from_proto,
    layout_to_proto,
    tensor_to_proto,
)
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.request import FinishReason, GenerationRequest, TokenEvent
from services.gpu_worker.leader_fence import LeaderFence
from services.gpu_worker.prefix_tier import ClusterPrefixTier
from services.gpu_worker.prefix_tier_grpc import serve_prefix_blocks
from services.gpu_worker.reply_coalescing import take_reply
from services.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.field_copy import message_of
from services.runtime.sampling.request_validation import check_first_token_deadline, check_request
from services.runtime.sampling.sampling_proto import sampling_from_proto
from services.runtime.security.acting_instance import acting_instance

MAX_PREFETCH_ADAPTERS = 64
"""Distinct adapters one ``Prefetch`` may name. Each starts a pull from the store: 3,000 at once held
the worker's event loop for 2.5 s and logged 65 MB of failures (the fuzz campaign,
docs/security.md)."""

FINISH_REASONS = {
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: types_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: types_pb2.FINISH_REASON_ERROR,
    FinishReason.MIGRATED: types_pb2.FINISH_REASON_MIGRATED,
}


def timings_to_proto(event: TokenEvent, prompt_tokens: int, preemptions: int = 0) -> types_pb2.Timings:
    t = event.timings

    def ms(at: float | None) -> float:
        return (at - t.arrived) * 1000 if at is not None else 0.0

    return types_pb2.Timings(
        queued_ms=ms(t.scheduled),
        first_token_ms=ms(t.first_token),
        total_ms=ms(t.finished),
        prompt_tokens=prompt_tokens,
        output_tokens=event.output_len,
        preemptions=preemptions,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves RPCs once :meth:`attach` has given it a started engine."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self.loader: AdapterLoader | None = None
        self.describe: dict = {}
        self._hand_off_targets: dict[str, str] = {}
        """request id -> worker it is being handed off to, until its stream has said so."""
        self.lane: LaneServer | None = None
        """This worker's same-host lending lane (None: lanes are off)."""
        self.leader_fence = LeaderFence()
        """The newest kv_manager leader term taken: DGFM calls of older terms are refused."""
        self.prefix_tier: ClusterPrefixTier | None = None
        """This worker's side of the cluster prefix tier (None: --cluster-prefix-cache off)."""
        self.lease_fence: LeaseFence | None = None
        """The etcd lease fence of this worker's registration (None: standalone, never fenced):
        while it is up, new requests and new loans are refused and what runs goes on."""

    def attach(self, engine: Engine, loader: AdapterLoader, describe: dict) -> None:
        self._engine, self.loader, self.describe = engine, loader, describe

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable("the worker is starting: the model is not loaded yet")
        return self._engine

    def _admit(self, what: str) -> None:
        """Unavailable, naming etcd, while the lease fence is up: a worker cut off from etcd takes
        no new ``what`` before its lease can expire elsewhere (services/runtime/etcd/lease_fence.py);
        the gateway places the request on another worker."""
        if self.lease_fence is not None and (problem := self.lease_fence.problem()):
            raise Unavailable(f"this gpu_worker takes no new {what}: {problem}")

    async def Generate(self, request: worker_pb2.GenerateRequest, context: aio.ServicerContext):
        self._admit("requests")
        engine = self.engine
        sampling = sampling_from_proto(request.sampling)
        config = engine.executor.config
        check_request(request.prompt_token_ids, sampling, config.vocab_size, config.max_position_embeddings)
        check_first_token_deadline(request.first_token_deadline_ms)
        if request.resumed_output_tokens > len(request.prompt_token_ids):
            raise InvalidArgument(
                f"resumed_output_tokens ({request.resumed_output_tokens}) exceeds the prompt's "
                f"{len(request.prompt_token_ids)} tokens"
            )
        adapter_id = request.adapter_id or None
        if adapter_id is not None:
            await self.loader.acquire(adapter_id)
        try:
            async for reply in self._generate(engine, request, sampling, adapter_id):
                yield reply
        finally:
            if adapter_id is not None:
                self.loader.release(adapter_id)

    async def _generate(self, engine: Engine, request: worker_pb2.GenerateRequest, sampling, adapter_id):
        request_id = request.request_id or uuid.uuid4().hex
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        generation = GenerationRequest(
            request_id,
            tuple(request.prompt_token_ids),
            sampling,
            adapter_id,
            predicted_output_tokens=request.predicted_output_tokens or None,
            first_token_deadline_s=request.first_token_deadline_ms / 1000 or None,
            resumed_output_tokens=request.resumed_output_tokens,
            prefix_cache_namespace=request.prefix_cache_namespace,
        )
        if self.prefix_tier is not None:  # the prompt's prefix from another worker, if cheaper
            await self.prefix_tier.prepare(generation)
        submit = functools.partial(
            engine.submit,
            generation,
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
        )
        if sampling.structured_output is not None:
            await asyncio.to_thread(submit)  # compiles its grammar: off the event loop
        else:
            submit()
        finished = False
        pending: collections.deque[TokenEvent] = collections.deque()
        try:
            while not finished:
                if not pending:
                    pending.append(await events.get())
                    while not events.empty():  # a step's tokens (accepted drafts) came together
                        pending.append(events.get_nowait())
                if pending[0].finish_reason is FinishReason.ABORTED:
                    finished = True
                    raise DeadlineExceeded(pending[0].error)
                if pending[0].finish_reason is FinishReason.NO_KV:
                    finished = True
                    raise ResourceExhausted(pending[0].error)
                reply, event = take_reply(pending, request_id)
                if event.finish_reason is not None:
                    finished = True
                    reply.finish_reason = FINISH_REASONS[event.finish_reason]
                    if event.finish_reason is FinishReason.MIGRATED:
                        reply.migrated_to = self._hand_off_targets.pop(request_id, "")
                    reply.timings.CopyFrom(timings_to_proto(event, len(request.prompt_token_ids)))
                yield reply
        finally:
            if not finished:  # the caller went away: free the request's pages now
                engine.cancel(request_id)

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context):
        was_resident = request.adapter_id in self.engine.residency
        adapter = await self.loader.ensure(request.adapter_id)
        self.engine.preload(request.adapter_id)
        return worker_pb2.LoadAdapterResponse(
            adapter_id=request.adapter_id,
            rank=adapter.max_rank,
            bytes=adapter.nbytes,
            was_resident=was_resident,
        )

    async def Prefetch(self, request: worker_pb2.PrefetchRequest, context):
        adapter_ids = list(dict.fromkeys(request.adapter_ids))
        if len(adapter_ids) > MAX_PREFETCH_ADAPTERS:
            raise InvalidArgument(
                f"Prefetch names {len(adapter_ids)} adapters: at most {MAX_PREFETCH_ADAPTERS} per call"
            )
        return worker_pb2.PrefetchResponse(started=self.loader.prefetch(adapter_ids))

    async def ListRequests(self, request: worker_pb2.ListRequestsRequest, context):
        engine = self.engine
        summaries = await asyncio.wrap_future(engine.between_steps(engine.list_requests))
        memory = engine.memory_tokens()
        return worker_pb2.ListRequestsResponse(
            requests=[
                worker_pb2.RequestLoad(
                    request_id=s.request_id,
                    adapter_id=s.adapter_id or "",
                    context_tokens=s.context_tokens,
                    remaining_tokens=s.remaining_tokens,
                    running=s.running,
                    waited_s=s.waited_s,
                )
                for s in summaries
            ],
            memory_tokens=memory.total,
            free_tokens=memory.free,
            max_running=engine.config.max_running,
            held_adapters=sorted(memory.adapter_tokens),
            adapter_tokens=memory.adapter_tokens,
        )

    async def HandOff(self, request: worker_pb2.HandOffRequest, context):
        if not request.request_id:
            raise InvalidArgument("request_id is empty: name the request to hand off (ListRequests)")
        if not request.target_worker_id:
            raise InvalidArgument("target_worker_id is empty: name the worker the request moves to")
        engine = self.engine
        self._hand_off_targets[request.request_id] = request.target_worker_id
        try:
            generated = await asyncio.wrap_future(
                engine.between_steps(lambda: engine.hand_off(request.request_id))
            )
        except BaseException:
            self._hand_off_targets.pop(request.request_id, None)
            raise
        return worker_pb2.HandOffResponse(generated_tokens=generated)

    async def Stats(self, request, context):
        return message_of(
            worker_pb2.WorkerStatsResponse,
            self.engine.stats(),
            model=self.describe["model"],
            dtype=self.describe["dtype"],
            dgfm_recalls=self.engine.recalls.recalls,
            dgfm_blocks_recalled=self.engine.recalls.blocks_recalled,
            kv_manager_term=self.leader_fence.term,
            leader_writes_accepted=self.leader_fence.accepted,
            leader_writes_refused=self.leader_fence.refused,
        )

    # -- lending (DistKV-LLM creditor side) ---------------------------------------------------
    # Each call runs on a thread of its own while the engine steps (never on the engine thread:
    # two workers borrowing from each other would wait for each other's step). Domain errors
    # become statuses in the runtime's interceptor; a bad call changes nothing for other debtors.

    def _lending(self, named: str) -> tuple[SharedLender, str]:
        """The lender, and the debtor a lending call acts for (the caller's own instance under
        mutual TLS: :func:`~services.runtime.security.acting_instance.acting_instance`)."""
        return self.engine.lending, acting_instance(named)

    async def AllocateBlocks(self, request: worker_pb2.AllocateBlocksRequest, context):
        self._admit("loans of KV blocks")
        lending, debtor = self._lending(request.debtor)
        layout = layout_from_proto(request.layout)
        ids = await asyncio.to_thread(lending.allocate, debtor, request.count, layout)
        return worker_pb2.AllocateBlocksResponse(block_ids=ids, layout=layout_to_proto(lending.layout))

    async def WriteKv(self, request: worker_pb2.WriteKvRequest, context):
        lending, debtor = self._lending(request.debtor)
        return await asyncio.to_thread(apply_write_kv, lending, debtor, request, self.engine.pool.device)

    async def FreeBlocks(self, request: worker_pb2.FreeBlocksRequest, context):
        lending, debtor = self._lending(request.debtor)
        await asyncio.to_thread(lending.free, debtor, list(request.block_ids))
        return worker_pb2.FreeBlocksResponse()

    async def AttendRemote(self, request: worker_pb2.AttendRemoteRequest, context):
        lending, debtor = self._lending(request.debtor)
        return await asyncio.to_thread(
            answer_attend_remote, lending, debtor, request, self.engine.pool.device
        )

    async def OpenLendingLane(self, request: worker_pb2.OpenLendingLaneRequest, context):
        _, debtor = self._lending(request.debtor)
        if self.lane is None:
            return worker_pb2.OpenLendingLaneResponse()
        return worker_pb2.OpenLendingLaneResponse(
            path=self.lane.path, token=self.lane.issue(debtor), tcp_port=self.lane.tcp_port
        )

    async def ReadBlocks(self, request: worker_pb2.ReadBlocksRequest, context):
        lending, debtor = self._lending(request.debtor)
        keys, values = await asyncio.to_thread(lending.read, debtor, list(request.block_ids))
        return worker_pb2.ReadBlocksResponse(keys=tensor_to_proto(keys), values=tensor_to_proto(values))

    # -- DGFM (issue 13): the kv_manager leader has this worker bring its blocks home ----------
    # Each call is applied by the engine thread between two steps (the freeze), awaited here,
    # once its leader term is taken (a deposed leader's is refused: issue 49).

    async def _between_steps(self, holder: str, apply):
        if not holder:
            raise InvalidArgument("holder is empty: name the worker that holds the blocks")
        return await asyncio.wrap_future(self.engine.between_steps(apply))

    async def RecallBlocks(self, request: worker_pb2.RecallBlocksRequest, context):
        self.leader_fence.admit(request.leader.term, request.leader.leader_id, "RecallBlocks")
        recalls = self.engine.recalls
        moved = await self._between_steps(
            request.holder, lambda: recalls.recall(request.holder, request.blocks)
        )
        return worker_pb2.RecallBlocksResponse(blocks_moved=moved)

    async def StageOutBlocks(self, request: worker_pb2.StageOutBlocksRequest, context):
        self.leader_fence.admit(request.leader.term, request.leader.leader_id, "StageOutBlocks")
        recalls = self.engine.recalls
        stage_id = await self._between_steps(
            request.holder, lambda: recalls.stage_out(request.holder, request.blocks)
        )
        return worker_pb2.StageOutBlocksResponse(stage_id=stage_id)

    async def StageInBlocks(self, request: worker_pb2.StageInBlocksRequest, context):
        self.leader_fence.admit(request.leader.term, request.leader.leader_id, "StageInBlocks")
        recalls = self.engine.recalls
        home = await asyncio.wrap_future(
            self.engine.between_steps(lambda: recalls.stage_in(request.stage_id))
        )
        return worker_pb2.StageInBlocksResponse(blocks_home=home)

    async def FetchPrefixBlocks(
        self, request: worker_pb2.FetchPrefixBlocksRequest, context: aio.ServicerContext
    ):
        tier = self.prefix_tier
        if tier is None:
            raise FailedPrecondition("this worker's cluster prefix cache is off (--cluster-prefix-cache off)")
        async for reply in serve_prefix_blocks(self.engine, tier.settings.kv_identity, request):
            yield reply
