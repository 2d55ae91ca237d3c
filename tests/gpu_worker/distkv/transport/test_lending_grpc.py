"""Lending over gRPC: a real loopback server with the worker's servicer over a real engine, reached
through ``GrpcCreditorTransport`` as a debtor's engine thread reaches it. Results match the
lender called in process bit for bit; bad calls get a clear status and the worker keeps serving
other debtors."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch
from grpc import aio
from support.worker_server import serve_worker

from mesh_api.v1 import worker_pb2, worker_pb2_grpc
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.distkv.transport.lending_proto import tensor_from_proto, tensor_to_proto
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

CAP = 6


@pytest.fixture
async def creditor(tiny_llama):
    """(engine, address) of a worker lending up to CAP blocks, serving on loopback."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=1, worker_id="creditor", max_lent_blocks=CAP))
    server, address = await serve_worker(engine, "tiny")
    try:
        yield engine, address
    finally:
        await server.stop(None)


def transport(creditor) -> GrpcCreditorTransport:
    engine, address = creditor
    return GrpcCreditorTransport("creditor", address, engine.pool.layout)


async def store(remote: GrpcCreditorTransport, debtor: str, layer: int, rows: KvRows[int]) -> None:
    """``rows`` stored through ``remote``, off the event loop (as the engine thread calls it)."""
    await asyncio.to_thread(lambda: remote.write_async(debtor, layer, rows).result())


def kv(n: int, kv_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, kv_dim, generator=generator), torch.randn(n, kv_dim, generator=generator)


async def test_lend_write_attend_read_free_match_the_lender_in_process(creditor, tiny_llama):
    engine, _ = creditor
    remote = transport(creditor)
    cfg = tiny_llama.config
    layout = engine.pool.layout
    block = layout.kv_block_tokens
    ids = await asyncio.to_thread(remote.allocate, "debtor-a", 2)
    assert len(ids) == 2 and engine.lending.lent_to() == {"debtor-a": 2}
    keys, values = kv(2 * block, layout.kv_dim, seed=1)
    targets = [ids[0]] * block + [ids[1]] * block
    slots = torch.arange(block).repeat(2)
    for layer in range(layout.num_layers):
        await store(remote, "debtor-a", layer, KvRows(targets, slots, keys + layer, values - layer))
    queries = torch.randn(3, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([block - 1, block + 2, 2 * block - 1])
    segment = AttendSegment(queries, positions, ids, [0, block])
    (partial,) = await asyncio.to_thread(lambda: remote.attend("debtor-a", AttendCall(1, [segment])).result())
    (expected,) = engine.lending.attend("debtor-a", AttendCall(1, [segment]))
    assert torch.equal(partial.output, expected.output) and torch.equal(partial.lse, expected.lse)
    read_keys, read_values = await asyncio.to_thread(remote.read, "debtor-a", ids)
    assert torch.equal(read_keys[1], keys + 1) and torch.equal(read_values[0], values)
    await asyncio.to_thread(remote.free, "debtor-a", ids)
    assert engine.lending.lent_to() == {}
    assert engine.rm.local.allocated_blocks == 0
    remote.close()


async def test_a_write_carried_by_the_attention_call_is_stored_first_or_not_at_all(creditor, tiny_llama):
    """A decode step's tail-block KV travels with its query: one round trip. A bad write is
    refused with the attention, and nothing of it is stored."""
    engine, _ = creditor
    remote = transport(creditor)
    cfg, layout = tiny_llama.config, engine.pool.layout
    (block_id,) = await asyncio.to_thread(remote.allocate, "debtor-a", 1)
    keys, values = kv(3, layout.kv_dim, seed=4)
    queries = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(5))
    segment = AttendSegment(queries, torch.tensor([2]), [block_id], [0])
    await store(remote, "debtor-a", 0, KvRows([block_id] * 2, torch.tensor([0, 1]), keys[:2], values[:2]))
    write = KvRows([block_id], torch.tensor([2]), keys[2:], values[2:])

    bad = KvRows([block_id], torch.tensor([layout.kv_block_tokens]), keys[2:], values[2:])
    with pytest.raises(InvalidArgument, match="slots must be"):
        await asyncio.to_thread(lambda: remote.attend("debtor-a", AttendCall(0, [segment], bad)).result())
    before, _ = await asyncio.to_thread(remote.read, "debtor-a", [block_id])
    assert not before[0, 2].any()  # the refused call stored nothing

    (partial,) = await asyncio.to_thread(
        lambda: remote.attend("debtor-a", AttendCall(0, [segment], write)).result()
    )
    (expected,) = engine.lending.attend("debtor-a", AttendCall(0, [segment]))  # over what the call stored
    assert torch.equal(partial.output, expected.output) and torch.equal(partial.lse, expected.lse)
    stored, _ = await asyncio.to_thread(remote.read, "debtor-a", [block_id])
    assert torch.equal(stored[0, :3], keys)
    await asyncio.to_thread(remote.free, "debtor-a", [block_id])
    remote.close()


async def test_bad_calls_get_clear_statuses_and_other_debtors_are_served(creditor, tiny_llama):
    engine, _ = creditor
    remote = transport(creditor)
    cfg = tiny_llama.config
    layout = engine.pool.layout
    mine = await asyncio.to_thread(remote.allocate, "debtor-a", 4)
    theirs = await asyncio.to_thread(remote.allocate, "debtor-b", 1)
    with pytest.raises(ResourceExhausted, match="cap of 6 blocks"):
        await asyncio.to_thread(remote.allocate, "debtor-c", 2)
    await asyncio.to_thread(remote.free, "debtor-a", mine[:1])
    keys, values = kv(1, layout.kv_dim, seed=3)
    with pytest.raises(NotFound, match=f"block {mine[0]} was freed"):
        await store(remote, "debtor-a", 0, KvRows(mine[:1], torch.tensor([0]), keys, values))
    queries = torch.randn(1, cfg.num_heads, cfg.head_dim)
    stolen = AttendSegment(queries, torch.tensor([0]), [theirs[0]], [0])
    with pytest.raises(PermissionDenied, match=f"block {theirs[0]} is not lent to debtor-a"):
        await asyncio.to_thread(lambda: remote.attend("debtor-a", AttendCall(0, [stolen])).result())
    with pytest.raises(InvalidArgument, match="keys must be"):
        await store(remote, "debtor-a", 0, KvRows(mine[1:2], torch.tensor([0]), keys[:, :3], values))

    # Nothing above changed the loans, and debtor-b is still served.
    assert engine.lending.lent_to() == {"debtor-a": 3, "debtor-b": 1}
    await store(remote, "debtor-b", 0, KvRows(theirs, torch.tensor([0]), keys, values))
    (partial,) = await asyncio.to_thread(
        lambda: remote.attend(
            "debtor-b", AttendCall(0, [AttendSegment(queries, torch.tensor([0]), theirs, [0])])
        ).result()
    )
    assert torch.isfinite(partial.lse).all()
    remote.close()


async def test_malformed_messages_are_invalid_arguments(creditor):
    engine, address = creditor
    async with aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(aio.AioRpcError) as anonymous:
            await stub.AllocateBlocks(worker_pb2.AllocateBlocksRequest(count=1))
        assert anonymous.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "debtor is empty" in anonymous.value.details()
        (block_id,) = (
            await stub.AllocateBlocks(
                worker_pb2.AllocateBlocksRequest(
                    debtor="debtor-a",
                    count=1,
                    layout=worker_pb2.KvBlockLayout(
                        kv_block_tokens=engine.pool.layout.kv_block_tokens,
                        num_layers=engine.pool.layout.num_layers,
                        kv_dim=engine.pool.layout.kv_dim,
                    ),
                )
            )
        ).block_ids
        short = tensor_to_proto(torch.zeros(1, engine.pool.layout.kv_dim))
        short.data = short.data[:-4]
        with pytest.raises(aio.AioRpcError) as truncated:
            await stub.WriteKv(
                worker_pb2.WriteKvRequest(
                    debtor="debtor-a",
                    layer=0,
                    block_ids=[block_id],
                    slots=tensor_to_proto(torch.tensor([0])),
                    keys=short,
                    values=short,
                )
            )
        assert truncated.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "do not hold a float32 tensor" in truncated.value.details()


async def test_blocks_of_another_shape_are_refused(creditor):
    engine, address = creditor
    layout = engine.pool.layout
    other = PoolLayout(0, layout.kv_block_tokens * 2, layout.kv_dim, layout.num_layers)
    with pytest.raises(FailedPrecondition, match="KV blocks differ"):
        await asyncio.to_thread(GrpcCreditorTransport("creditor", address, other).allocate, "debtor-a", 1)
    assert engine.lending.lent_to() == {}


def test_an_unreachable_creditor_is_unavailable():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    remote = GrpcCreditorTransport("gone", address, PoolLayout(0, 4, 16, 2))
    with pytest.raises(Unavailable, match="creditor gone"):
        remote.allocate("debtor-a", 1)
    remote.close()


def test_tensors_round_trip_in_every_wire_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tensor = (torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5).to(dtype)
        assert torch.equal(tensor_from_proto(tensor_to_proto(tensor), "t"), tensor)
    empty = torch.empty(0, 4)
    assert tensor_from_proto(tensor_to_proto(empty), "t").shape == (0, 4)
