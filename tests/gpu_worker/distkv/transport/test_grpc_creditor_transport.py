"""The lending traffic a debtor's gRPC transport counts, against a creditor worker serving on
loopback (the real servicer over a real engine, tiny Llama, fp32): the bytes are the serialized
messages exactly, and a debtor engine borrowing through it shows its DistKV figures per peer,
per step and in its heartbeat."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.worker_server import serve_worker

from mesh_api.v1 import worker_pb2
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.build import local_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.transport import grpc_creditor_transport
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.distkv.transport.lending_proto import (
    layout_to_proto,
    partials_to_proto,
    segment_to_proto,
    tensor_to_proto,
)
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.service import WorkerService
from services.gpu_worker.worker_metrics import WorkerMetrics, WorkerParts
from services.runtime.rpc import keepalive
from services.runtime.security.tls import sync_channel

BLOCK = 4
SMALL_POOL_MIB = 1 / 64  # tiny Llama: 16 pages of 4 tokens = 8 blocks of 2 layers = 32 tokens


def engine(tiny_llama, config: EngineConfig, **kwargs) -> Engine:
    return local_engine(LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), config, **kwargs)


@pytest.fixture
async def creditor(tiny_llama):
    """(engine, address) of a worker lending up to 16 blocks, serving on loopback."""
    lender = engine(
        tiny_llama, EngineConfig(pool_mib=1, kv_block_tokens=BLOCK, worker_id="creditor", max_lent_blocks=16)
    )
    server, address = await serve_worker(lender, "tiny")
    try:
        yield lender, address
    finally:
        await server.stop(None)


def test_the_channel_to_a_creditor_pings_as_the_service_channels_do(monkeypatch):
    opened = []

    def record(address, tls, options=()):
        opened.append(dict(options))
        return sync_channel(address, tls, options)

    monkeypatch.setattr(grpc_creditor_transport, "sync_channel", record)
    GrpcCreditorTransport("creditor", "127.0.0.1:1", PoolLayout(0, 4, 16, 2), lane="off").close()
    assert opened[0].items() >= dict(keepalive.CHANNEL_OPTIONS).items()
    assert opened[0]["grpc.keepalive_time_ms"] == keepalive.PING_EVERY_S * 1000
    assert opened[0]["grpc.keepalive_timeout_ms"] == keepalive.PING_TIMEOUT_S * 1000


def size(message) -> int:
    return len(message.SerializeToString())


async def test_bytes_are_the_serialized_requests_and_replies(creditor, tiny_llama):
    lender, address = creditor
    layout = lender.pool.layout
    remote = GrpcCreditorTransport("creditor", address, layout, lane="off")
    ids = await asyncio.to_thread(remote.allocate, "debtor", 2)
    sent = size(worker_pb2.AllocateBlocksRequest(debtor="debtor", count=2, layout=layout_to_proto(layout)))
    received = size(worker_pb2.AllocateBlocksResponse(block_ids=ids, layout=layout_to_proto(layout)))
    assert (remote.meter.totals().remote_bytes_sent, remote.meter.totals().remote_bytes_received) == (
        sent,
        received,
    )

    slots = torch.arange(BLOCK)
    keys = torch.randn(BLOCK, layout.kv_dim, generator=torch.Generator().manual_seed(1))
    rows = KvRows([ids[0]] * BLOCK, slots, keys, -keys)
    await asyncio.to_thread(lambda: remote.write_async("debtor", 0, rows).result())
    sent += size(
        worker_pb2.WriteKvRequest(
            debtor="debtor", layer=0, block_ids=[ids[0]] * BLOCK, slots=tensor_to_proto(slots),
            keys=tensor_to_proto(keys), values=tensor_to_proto(-keys),
        )
    )  # fmt: skip
    cfg = tiny_llama.config
    queries = torch.randn(3, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    attend = AttendSegment(queries, torch.tensor([1, 2, 3]), [ids[0]], [0])
    partials = await asyncio.to_thread(lambda: remote.attend("debtor", AttendCall(0, [attend])).result())
    sent += size(
        worker_pb2.AttendRemoteRequest(debtor="debtor", layer=0, segments=[segment_to_proto(attend)])
    )
    received += size(partials_to_proto(partials))
    read_keys, read_values = await asyncio.to_thread(remote.read, "debtor", ids[:1])
    sent += size(worker_pb2.ReadBlocksRequest(debtor="debtor", block_ids=ids[:1]))
    received += size(
        worker_pb2.ReadBlocksResponse(keys=tensor_to_proto(read_keys), values=tensor_to_proto(read_values))
    )
    await asyncio.to_thread(remote.free, "debtor", ids)
    sent += size(worker_pb2.FreeBlocksRequest(debtor="debtor", block_ids=ids))

    totals = remote.meter.totals()
    assert (totals.remote_bytes_sent, totals.remote_bytes_received) == (sent, received)
    assert received > keys.numel() * 4 * 2  # the KV read back crossed the wire
    assert lender.distkv.totals().lent_attention_calls == 1
    remote.close()


class OneCreditor:
    """A gManager that always suggests the same creditor."""

    def __init__(self, address: str):
        self.address = address

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        return [Candidate("creditor", self.address, 16)]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        raise AssertionError(f"{creditor} refused {debtor}")


def collected(metrics: WorkerMetrics) -> dict[str, dict]:
    """``{series: {labels or sample name: value}}`` of one collection."""
    out: dict[str, dict] = {}
    for family in metrics.collect():
        series = out.setdefault(family.name, {})
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items())) if sample.name == family.name else sample.name
            series[key] = sample.value
    return out


async def test_a_borrowing_debtor_reports_its_lending_traffic(creditor, tiny_llama):
    lender, address = creditor
    debtor = engine(
        tiny_llama,
        EngineConfig(
            pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id="debtor", kv_overflow="borrow"
        ),
        creditors=OneCreditor(address),
        connect=lambda c, a: GrpcCreditorTransport(c, a, debtor.pool.layout, debtor.distkv),
    )
    debtor_metrics = WorkerMetrics(lambda: WorkerParts(debtor, None, "tiny"))
    debtor_metrics.attach(debtor, None)
    lender_metrics = WorkerMetrics(lambda: WorkerParts(lender, None, "tiny"))
    tokens: list[int] = []
    prompt = tuple(range(3, 3 + 40))  # 10 blocks: 8 local, 2 borrowed
    debtor.submit(
        GenerationRequest("long", prompt, SamplingParams(max_tokens=3, ignore_eos=True)),
        lambda event: tokens.append(event.token_id),
    )
    await asyncio.to_thread(debtor.step)  # the prefill, its KV on both workers

    peer = (("peer", "creditor"),)
    borrowed = collected(debtor_metrics)["loramesh_gpu_worker_kv_blocks_borrowed"]
    assert borrowed == {peer: debtor.rm.borrowed()["creditor"]} and borrowed[peer] >= 2
    lent = collected(lender_metrics)["loramesh_gpu_worker_kv_blocks_lent"]
    assert lent == {(("peer", "debtor"),): borrowed[peer]}

    while debtor.has_work():
        await asyncio.to_thread(debtor.step)
    assert len(tokens) == 3

    totals = debtor.distkv.totals()
    layers = tiny_llama.config.num_layers
    # The prefill attended over the prompt's KV in hand; every later step over the remote
    # blocks, once per layer.
    assert totals.remote_attention_calls == layers * (debtor.steps - 1)
    assert totals.remote_attention_s > 0 and totals.remote_bytes_sent > 0 and totals.remote_bytes_received > 0
    assert lender.distkv.totals().lent_attention_calls == totals.remote_attention_calls
    after = collected(debtor_metrics)
    assert (
        after["loramesh_gpu_worker_remote_attention_step_seconds"][
            "loramesh_gpu_worker_remote_attention_step_seconds_count"
        ]
        == debtor.steps - 1  # the steps that waited on remote attention
    )
    assert after["loramesh_gpu_worker_kv_blocks_borrowed"] == {}  # all given back: the series is gone
    assert collected(lender_metrics)["loramesh_gpu_worker_kv_blocks_lent"] == {}

    service = WorkerService(WorkerConfig(instance_id="debtor"))
    service.engine = debtor
    report = service.load_report()
    assert {key: report[key] for key in ("remote_attention_calls", "remote_bytes_sent", "decode_steps")} == {
        "remote_attention_calls": totals.remote_attention_calls,
        "remote_bytes_sent": totals.remote_bytes_sent,
        "decode_steps": debtor.steps,
    }
    assert report["remote_attention_s"] == totals.remote_attention_s
    assert report["lent_attention_s"] == 0.0
    assert report["kv_overflow"] == "borrow"  # the policy in force, for `loramesh status`
