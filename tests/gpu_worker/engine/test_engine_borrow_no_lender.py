"""A request that only borrowed KV blocks could start, when no worker lends them (issue 49's
"defect 4"): the gManager suggests nobody, the creditor it suggests is gone, or that creditor
refuses. The request waits for a lender at most ``loan_wait_s`` by the engine's clock, and at
least ``loan_wait_rounds`` admission rounds in which only a loan could start it (besides waiting,
as before, for its worker's running requests to make room), and is then refused
(``FinishReason.NO_KV``, RESOURCE_EXHAUSTED over gRPC) naming why; the requests queued behind it
start meanwhile instead of waiting with it. A lender that comes back within the bound lends.

Tiny random Llama, fp32, engines stepped by hand: the rounds are counted in steps, and the time
is an injected clock's (``loan_wait_s`` 0 where a test counts rounds alone).
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc import aio
from support.in_process_transport import InProcessTransport
from support.worker_server import serve_worker

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import ResourceExhausted

BLOCK = 4
SMALL_POOL_MIB = 1 / 64
"""Tiny Llama: 1 KiB pages (4 tokens x kv_dim 32 x K,V fp32), 16 pages = 8 blocks of 2 layers."""
ROUNDS = 5


class Lenders:
    """The gManager and the creditors as the debtor ``w0`` sees them. ``mode``: ``none`` (the
    gManager suggests nobody), ``gone`` (it suggests ``w1``, whose process is dead), ``refuses``
    (``w1`` lives but lends nothing: its cap is 0) or ``lends`` (``w1`` lends); ``silent_rounds``:
    suggestions answered with nobody before ``mode`` applies."""

    def __init__(self, tiny_llama, mode: str, silent_rounds: int = 0):
        self.mode, self.silent_rounds = mode, silent_rounds
        self.suggestions = 0
        self.refusals: list[str] = []
        cap = 0 if mode == "refuses" else 12
        self.creditor = engine(tiny_llama, "w1", pool_mib=4 * SMALL_POOL_MIB, max_lent_blocks=cap)
        self.transport = InProcessTransport("w1", self.creditor.rm.lender)
        if mode == "gone":
            self.transport.kill()

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        self.suggestions += 1
        if self.mode == "none" or self.suggestions <= self.silent_rounds:
            raise ResourceExhausted(f"no worker can lend {blocks} KV blocks now")
        return [Candidate("w1", "w1", 12)]  # a heartbeat's view: stale when w1 is gone or refuses

    def report_refusal(self, debtor: str, creditor: str) -> None:
        self.refusals.append(creditor)

    def connect(self, creditor: str, address: str) -> InProcessTransport:
        return self.transport


def engine(tiny_llama, name: str, lenders: Lenders | None = None, **config) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    defaults = {
        "pool_mib": SMALL_POOL_MIB,
        "kv_block_tokens": BLOCK,
        "kv_overflow": "borrow",
        "loan_wait_s": 0.0,
        "speculative": "off",  # the rounds are counted in steps: one token a step
    }
    settings = EngineConfig(worker_id=name, loan_wait_rounds=ROUNDS, **{**defaults, **config})
    if lenders is None:  # a creditor: it never borrows itself
        return local_engine(model, settings, creditors=_Nobody(), connect=lambda creditor, address: None)
    return local_engine(model, settings, creditors=lenders, connect=lenders.connect)


class _Nobody:
    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        raise ResourceExhausted("nobody lends to a creditor here")

    def report_refusal(self, debtor: str, creditor: str) -> None:
        pass


def greedy(request_id: str, prompt_len: int, max_tokens: int) -> GenerationRequest:
    prompt = tuple((11 * j + 5) % 250 + 1 for j in range(prompt_len))
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class Stream:
    """One request's events, and the step each came at."""

    def __init__(self, debtor: Engine, request: GenerationRequest, steps: list[int]):
        self.tokens: list[int] = []
        self.first_token_step: int | None = None
        self.finish: FinishReason | None = None
        self.finish_step: int | None = None
        self.error = ""

        def sink(event) -> None:
            if event.token_id is not None:
                self.tokens.append(event.token_id)
                if self.first_token_step is None:
                    self.first_token_step = steps[0]
            if event.finish_reason is not None:
                self.finish, self.finish_step, self.error = event.finish_reason, steps[0], event.error

        debtor.submit(request, sink)


def run_long_then_short(debtor: Engine, max_steps: int) -> tuple[Stream, Stream, int]:
    """A prompt larger than the pool (60 tokens: 15 blocks of 8), then a short one queued
    behind it; both stepped until the engine has no work, at most ``max_steps`` steps."""
    steps = [0]
    long = Stream(debtor, greedy("long", 60, 4), steps)
    short = Stream(debtor, greedy("short", 8, 4), steps)
    while debtor.has_work() and steps[0] < max_steps:
        steps[0] += 1
        debtor.step()
    return long, short, steps[0]


@pytest.mark.parametrize("mode", ["none", "gone", "refuses"])
def test_a_request_no_worker_lends_to_is_refused_within_the_bound_and_holds_nobody_back(tiny_llama, mode):
    lenders = Lenders(tiny_llama, mode)
    debtor = engine(tiny_llama, "w0", lenders)
    long, short, steps = run_long_then_short(debtor, max_steps=ROUNDS + 20)
    assert not debtor.has_work(), f"still waiting after {steps} steps"
    # The short request behind it ran from the first step, not after the long one's end.
    assert short.finish is FinishReason.LENGTH and len(short.tokens) == 4
    assert short.first_token_step == 1
    # The long one waited for the short one's 3 decode steps (its pool's room), and ROUNDS
    # rounds in which only a loan could start it (steps 1 and 5 on), then was refused, naming why.
    assert long.finish is FinishReason.NO_KV and long.tokens == []
    assert long.finish_step == ROUNDS + 3
    assert "15 KV blocks" in long.error and "no worker lent" in long.error, long.error
    if mode == "none":
        assert "no worker can lend" in long.error, long.error
    else:
        assert lenders.refusals and set(lenders.refusals) == {"w1"}
    # Nothing borrowed or lent is left behind, on either side.
    assert debtor.rm.accounting().borrowed_blocks == {}
    assert lenders.creditor.rm.accounting().lent_blocks == {}
    assert (
        debtor.pool.usage().free_pages + debtor.prefix_cache.evictable_pages() == debtor.pool.layout.num_pages
    )


class Clock:
    """The engine's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def waiting_long(tiny_llama) -> tuple[Engine, Clock, Stream, list[int]]:
    """A debtor nobody lends to, bound by ``loan_wait_s`` 30 (and ROUNDS rounds), on an injected
    clock, with the long request queued."""
    debtor = engine(tiny_llama, "w0", Lenders(tiny_llama, "none"), loan_wait_s=30.0)
    clock = Clock()
    debtor.scheduler.clock = clock
    steps = [0]
    return debtor, clock, Stream(debtor, greedy("long", 60, 4), steps), steps


def step(debtor: Engine, steps: list[int], times: int = 1) -> None:
    for _ in range(times):
        steps[0] += 1
        debtor.step()


def test_a_fast_worker_waits_the_time_bound_not_just_the_rounds(tiny_llama):
    """Four times ROUNDS rounds at one instant (a machine fast enough to run them at once): the
    request still waits; it is refused at the first round 30 s after its first."""
    debtor, clock, long, steps = waiting_long(tiny_llama)
    step(debtor, steps, 4 * ROUNDS)
    assert long.finish is None and debtor.has_work()
    clock.now += 29.9
    step(debtor, steps)
    assert long.finish is None
    clock.now += 0.1
    step(debtor, steps)
    assert long.finish is FinishReason.NO_KV and long.tokens == []
    assert "no worker lent the rest in 30.0 s" in long.error, long.error
    assert f"{4 * ROUNDS + 2} admission rounds" in long.error, long.error


def test_a_slow_worker_still_asks_the_rounds_floor_before_refusing(tiny_llama):
    """Each round 60 s after the last (a loaded machine): past the time bound after the second,
    the request is still let ask ROUNDS times."""
    debtor, clock, long, steps = waiting_long(tiny_llama)
    for _ in range(ROUNDS - 1):
        step(debtor, steps)
        clock.now += 60.0
    assert long.finish is None
    step(debtor, steps)
    assert long.finish is FinishReason.NO_KV
    assert f"in {60.0 * (ROUNDS - 1):.1f} s ({ROUNDS} admission rounds" in long.error, long.error


def test_a_lender_back_within_the_bound_lends_and_the_request_completes(tiny_llama):
    lenders = Lenders(tiny_llama, "lends", silent_rounds=ROUNDS - 2)
    debtor = engine(tiny_llama, "w0", lenders)
    long, short, _ = run_long_then_short(debtor, max_steps=ROUNDS + 40)
    assert short.finish is FinishReason.LENGTH and short.first_token_step == 1
    assert long.finish is FinishReason.LENGTH and len(long.tokens) == 4
    assert long.first_token_step == ROUNDS - 1  # it borrowed at the first suggestion that lent
    assert debtor.rm.accounting().borrowed_blocks == {}
    assert lenders.creditor.rm.accounting().lent_blocks == {}


async def test_the_refusal_is_resource_exhausted_over_grpc_naming_why(tiny_llama):
    debtor = engine(tiny_llama, "w0", Lenders(tiny_llama, "none"))
    debtor.start()  # idle between rounds: a round every IDLE_WAIT_S, ROUNDS of them
    server, address = await serve_worker(debtor)
    try:
        async with aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.GenerateRequest(
                request_id="long", prompt_token_ids=list(greedy("long", 60, 4).prompt_ids),
                sampling=types_pb2.SamplingParams(max_tokens=4),
            )  # fmt: skip
            with pytest.raises(aio.AioRpcError) as refused:
                _ = [reply async for reply in stub.Generate(request)]
    finally:
        await server.stop(None)
        debtor.stop()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no worker lent" in refused.value.details() and "no worker can lend" in refused.value.details()
