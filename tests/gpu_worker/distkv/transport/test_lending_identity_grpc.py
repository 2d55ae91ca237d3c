"""Lending bound to the caller's certificate (mutual TLS, the authorization table on): a debtor
borrows KV blocks of a creditor as itself; a second worker's certificate asking to read or free
those blocks is refused, whichever debtor it names, and the first debtor's request finishes with
the greedy output of one big-pool engine, its loans untouched. The real servicer and interceptor
over tiny-Llama engines (fp32) on loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.one_creditor import OneCreditor, step_until
from support.worker_server import serve_worker

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import PermissionDenied
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates

BLOCK = 4
SMALL_POOL_MIB = 1 / 64  # tiny Llama: 16 pages of 4 tokens = 8 blocks of 2 layers = 32 tokens
FIRST, SECOND, CREDITOR = "gpu_worker-0", "gpu_worker-1", "gpu_worker-2"


def engine(tiny_llama, config: EngineConfig, **kwargs) -> Engine:
    return local_engine(LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), config, **kwargs)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    """Each worker's own certificate, as `loramesh up --tls` issues them, and a shared one."""
    identities = [f"gpu_worker/{name}" for name in (FIRST, SECOND, CREDITOR)] + ["gpu_worker", "scheduler"]
    return create_mesh_certificates(tmp_path_factory.mktemp("certs"), identities)


@pytest.fixture
async def creditor(tiny_llama, certs):
    """(engine, address) of a worker lending up to 16 blocks over mutual TLS."""
    lender = engine(
        tiny_llama, EngineConfig(pool_mib=1, kv_block_tokens=BLOCK, worker_id=CREDITOR, max_lent_blocks=16)
    )
    server, address = await serve_worker(lender, "tiny", certs.tls_for(f"gpu_worker/{CREDITOR}"))
    try:
        yield lender, address
    finally:
        await server.stop(None)


async def test_another_workers_certificate_cannot_read_or_free_blocks_lent_to_the_first(
    creditor, certs, tiny_llama
):
    lender, address = creditor
    prompt = tuple((7 * j + 3) % 250 + 1 for j in range(40))  # 10 blocks at first: 8 local, 2 borrowed
    request = GenerationRequest("long", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    big = engine(tiny_llama, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK))
    expected: list[int] = []
    big.submit(request, lambda event: event.token_id is not None and expected.append(event.token_id))
    step_until(big, lambda: False)

    debtor = engine(
        tiny_llama,
        EngineConfig(pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id=FIRST, kv_overflow="borrow"),
        creditors=OneCreditor(CREDITOR, address),
        connect=lambda c, a: GrpcCreditorTransport(
            c, a, debtor.pool.layout, debtor.distkv, tls=certs.tls_for(f"gpu_worker/{FIRST}")
        ),
    )
    tokens: list[int] = []
    debtor.submit(request, lambda event: event.token_id is not None and tokens.append(event.token_id))
    await asyncio.to_thread(step_until, debtor, lambda: FIRST in lender.lending.lent_to())
    assert len(tokens) < len(expected)  # mid-request, with blocks lent
    lent = lender.lending.lender.blocks_of(FIRST)
    loans = lender.lending.lent_to()
    kv_before = lender.lending.read(FIRST, lent)

    def as_worker(identity: str) -> GrpcCreditorTransport:
        return GrpcCreditorTransport(CREDITOR, address, debtor.pool.layout, tls=certs.tls_for(identity))

    second = as_worker(f"gpu_worker/{SECOND}")
    for call in (second.read, second.free):
        with pytest.raises(PermissionDenied, match=f"may not act for debtor '{FIRST}'"):
            await asyncio.to_thread(call, FIRST, lent)
        with pytest.raises(PermissionDenied, match=f"block {lent[0]} is not lent to {SECOND}"):
            await asyncio.to_thread(call, SECOND, lent)
        with pytest.raises(PermissionDenied, match=f"block {lent[0]} is not lent to {SECOND}"):
            await asyncio.to_thread(call, "", lent)  # no name: the caller's own instance
    shared = as_worker("gpu_worker")
    with pytest.raises(PermissionDenied, match="names no instance"):
        await asyncio.to_thread(shared.read, FIRST, lent)
    scheduler = as_worker("scheduler")
    with pytest.raises(
        PermissionDenied, match="'scheduler' identity may not call loramesh.v1.Worker/FreeBlocks"
    ):
        await asyncio.to_thread(scheduler.free, FIRST, lent)
    for transport in (second, shared, scheduler):
        transport.close()

    assert lender.lending.lent_to() == loans
    kv_after = lender.lending.read(FIRST, lent)
    assert all(torch.equal(before, after) for before, after in zip(kv_before, kv_after, strict=True))
    await asyncio.to_thread(step_until, debtor, lambda: False)
    assert tokens == expected
    assert lender.lending.lent_to() == {} and debtor.rm.accounting().borrowed_blocks == {}
