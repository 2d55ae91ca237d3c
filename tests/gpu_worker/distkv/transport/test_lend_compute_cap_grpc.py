"""DistKV-LLM's compute cap over loopback gRPC (the real servicer and interceptor over tiny-Llama
engines, fp32): a creditor over its ``--lend-compute-share`` answers AttendRemote with
RESOURCE_EXHAUSTED naming the cap, and a debtor borrowing from it gives its blocks back and
finishes its request on another creditor with the greedy output of one big-pool engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.worker_server import serve_worker

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment
from services.gpu_worker.distkv.lend_compute_cap import LendComputeCap
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import ResourceExhausted

BLOCK = 4
SMALL_POOL_MIB = 1 / 64  # tiny Llama: 16 pages of 4 tokens = 8 blocks of 2 layers = 32 tokens


def engine(tiny_llama, config: EngineConfig, **kwargs) -> Engine:
    return local_engine(LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), config, **kwargs)


def lender(tiny_llama, name: str) -> Engine:
    return engine(
        tiny_llama, EngineConfig(pool_mib=1, kv_block_tokens=BLOCK, worker_id=name, max_lent_blocks=16)
    )


@pytest.fixture
async def creditors(tiny_llama):
    """``{name: (engine, address)}``: "busy", whose cap lends no compute while it has requests
    of its own (and it always has), and "idle", uncapped; both serve on loopback."""
    engines = {"busy": lender(tiny_llama, "busy"), "idle": lender(tiny_llama, "idle")}
    engines["busy"].lending.cap = LendComputeCap(share=0.0, busy=lambda: True)
    served = {name: await serve_worker(e, "tiny") for name, e in engines.items()}
    try:
        yield {name: (engines[name], served[name][1]) for name in engines}
    finally:
        for server, _ in served.values():
            await server.stop(None)


async def test_the_refusal_is_resource_exhausted_naming_the_cap(creditors, tiny_llama):
    busy, address = creditors["busy"]
    remote = GrpcCreditorTransport("busy", address, busy.pool.layout)
    ids = await asyncio.to_thread(remote.allocate, "debtor", 1)  # blocks are still lent
    cfg = tiny_llama.config
    queries = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    with pytest.raises(ResourceExhausted, match="--lend-compute-share is 0") as refused:
        await asyncio.to_thread(
            lambda: remote.attend(
                "debtor", AttendCall(0, [AttendSegment(queries, torch.tensor([0]), ids, [0])])
            ).result()
        )
    assert "creditor busy" in refused.value.message
    assert busy.distkv.totals().lent_attention_refused == 1
    await asyncio.to_thread(remote.free, "debtor", ids)
    remote.close()


class BusyFirst:
    """A gManager suggesting "busy" before "idle", until "busy" is reported as refusing."""

    def __init__(self, addresses: dict[str, str]):
        self.addresses = addresses
        self.refusals: list[tuple[str, str]] = []

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        refused = {creditor for _, creditor in self.refusals}
        return [Candidate(n, self.addresses[n], 16) for n in ("busy", "idle") if n not in refused]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        self.refusals.append((debtor, creditor))


def generate(debtor: Engine, request: GenerationRequest) -> list[int]:
    tokens: list[int] = []
    debtor.submit(request, lambda event: event.token_id is not None and tokens.append(event.token_id))
    while debtor.has_work():
        debtor.step()
    return tokens


async def test_a_debtor_refused_by_one_creditor_finishes_on_another_with_the_same_output(
    creditors, tiny_llama
):
    prompt = tuple((7 * j + 3) % 250 + 1 for j in range(40))  # 10 blocks at first: 8 local, 2 borrowed
    request = GenerationRequest("long", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    expected = generate(engine(tiny_llama, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK)), request)

    directory = BusyFirst({name: address for name, (_, address) in creditors.items()})
    debtor = engine(
        tiny_llama,
        EngineConfig(
            pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id="debtor", kv_overflow="borrow"
        ),
        creditors=directory,
        connect=lambda c, a: GrpcCreditorTransport(c, a, debtor.pool.layout, debtor.distkv),
    )
    assert await asyncio.to_thread(generate, debtor, request) == expected

    busy, idle = creditors["busy"][0], creditors["idle"][0]
    assert directory.refusals == [("debtor", "busy")]
    assert debtor.distkv.totals().remote_attention_refused == 1 and debtor.preemptions == 1
    assert busy.distkv.totals().lent_attention_refused == 1
    assert busy.distkv.totals().lent_attention_calls == 0
    assert idle.distkv.totals().lent_attention_calls > 0
    assert busy.lending.lent_to() == {} and idle.lending.lent_to() == {}  # all given back
    assert debtor.rm.accounting().borrowed_blocks == {}
