"""The same-host lending lane (``services/gpu_worker/distkv/transport/lending_lane.py``): a debtor's transport opens
it through the creditor's ``OpenLendingLane`` RPC, then attends and writes over a Unix socket with
the same answers as over gRPC, the same refusals, and the debtor bound to the token the creditor
issued to the caller; a peer is refused after reading only a frame's header unless its first
frame is a small hello with an unexpired token of this creditor; a creditor whose lane closes is
unreachable, as a dead one is over gRPC."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading

import pytest
import torch
from support.polling import HANG_GUARD_S
from support.worker_server import serve_worker

from mesh_api.v1 import worker_pb2
from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.distkv_meter import DistKvMeter
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport, _refusal
from services.gpu_worker.distkv.transport.lending_lane import (
    ATTEND,
    HELLO,
    OK,
    REFUSED,
    WRITE,
    LaneClient,
    LaneServer,
    _frame,
    _read_frame,
)
from services.gpu_worker.distkv.transport.lending_proto import segment_to_proto
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.service import lane_mode
from services.runtime.errors import FailedPrecondition, PermissionDenied, Unavailable


@pytest.fixture
async def creditor(tiny_llama):
    """(engine, lane, address) of a lending worker serving its RPCs and its lane."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=1, worker_id="creditor", max_lent_blocks=8))
    lane = LaneServer(engine.lending, engine.pool.device)
    server, address = await serve_worker(engine, "tiny", lane=lane)
    try:
        yield engine, lane, address
    finally:
        lane.close()
        await server.stop(None)


def run(call):
    return asyncio.to_thread(call)


async def test_the_lane_answers_as_the_rpcs_do_and_counts_its_bytes(creditor, tiny_llama):
    engine, _, address = creditor
    layout, cfg = engine.pool.layout, tiny_llama.config
    over_lane = GrpcCreditorTransport("creditor", address, layout)
    over_grpc = GrpcCreditorTransport("creditor", address, layout, lane="off")
    ids = await run(lambda: over_lane.allocate("debtor-a", 2))
    block = layout.kv_block_tokens
    keys = torch.randn(block, layout.kv_dim, generator=torch.Generator().manual_seed(1))
    rows = KvRows([ids[0]] * block, torch.arange(block), keys, -keys)
    await run(lambda: over_lane.write_async("debtor-a", 1, rows).result())
    assert over_lane._lane is not None  # the write took the lane

    queries = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    segment = AttendSegment(queries, torch.tensor([3, block - 1]), [ids[0]], [0])
    tail = KvRows([ids[1]], torch.tensor([0]), keys[:1] * 2, keys[:1])
    sent_before = over_lane.meter.totals().remote_bytes_sent
    (lane_partial,) = await run(lambda: over_lane.attend("debtor-a", AttendCall(1, [segment], tail)).result())
    assert over_lane.meter.totals().remote_bytes_sent > sent_before
    (grpc_partial,) = await run(lambda: over_grpc.attend("debtor-a", AttendCall(1, [segment])).result())
    assert torch.equal(lane_partial.output, grpc_partial.output) and torch.equal(
        lane_partial.lse, grpc_partial.lse
    )
    stored, _ = await run(lambda: over_grpc.read("debtor-a", ids[1:]))
    assert torch.equal(stored[1, 0], keys[0] * 2)  # the write carried by the lane's attention call

    theirs = await run(lambda: over_grpc.allocate("debtor-b", 1))
    stolen = AttendSegment(queries[:1], torch.tensor([0]), theirs, [0])
    with pytest.raises(PermissionDenied, match=f"block {theirs[0]} is not lent to debtor-a"):
        await run(lambda: over_lane.attend("debtor-a", AttendCall(0, [stolen])).result())
    # the lane is still open
    (after,) = await run(lambda: over_lane.attend("debtor-a", AttendCall(1, [segment])).result())
    assert torch.equal(after.output, lane_partial.output)
    await run(lambda: over_grpc.free("debtor-a", ids))
    await run(lambda: over_grpc.free("debtor-b", theirs))
    over_lane.close()
    over_grpc.close()


async def test_a_connection_acts_only_for_the_debtor_its_token_was_issued_to(creditor, tiny_llama):
    engine, lane, address = creditor
    with socket.socket(socket.AF_UNIX) as unknown:
        unknown.connect(lane.path)
        unknown.sendall(_frame(HELLO, b"0" * 32))
        status, reply = _read_frame(unknown)
    assert status != OK and reply.startswith(b"UNAUTHENTICATED")

    over_grpc = GrpcCreditorTransport("creditor", address, engine.pool.layout, lane="off")
    ids = await run(lambda: over_grpc.allocate("debtor-a", 1))
    as_b = LaneClient.over_unix("creditor", lane.path, lane.issue("debtor-b"), DistKvMeter(), _refusal, 10.0)
    queries = torch.randn(1, tiny_llama.config.num_heads, tiny_llama.config.head_dim)
    request = worker_pb2.AttendRemoteRequest(
        debtor="debtor-a",  # the token's debtor counts, not the name in the message
        layer=0,
        segments=[segment_to_proto(AttendSegment(queries, torch.tensor([0]), ids, [0]))],
    )
    with pytest.raises(PermissionDenied, match=f"block {ids[0]} is not lent to debtor-b"):
        await run(lambda: as_b.call(ATTEND, request, lambda data: data).result())
    as_b.close()
    await run(lambda: over_grpc.free("debtor-a", ids))
    over_grpc.close()


def serve_one(lane: LaneServer, connection: socket.socket) -> None:
    """``connection`` served by ``lane`` to its end, on a thread of its own as the lane does."""
    thread = threading.Thread(target=lane.serve, args=(connection,))
    thread.start()
    thread.join()


@pytest.mark.parametrize("kind", [HELLO, WRITE], ids=["hello", "write"])
def test_a_peer_sending_a_4_gib_frame_first_is_dropped_after_its_header(creditor, kind, caplog):
    """Nothing of a frame but its five header bytes is read before a token: not a 4 GiB hello,
    not a first frame of another kind."""
    _, lane, _ = creditor
    peer, served = socket.socketpair(socket.AF_UNIX)
    kept = served.dup()  # what the lane leaves unread stays readable here once it closes its end
    following = b"\xff" * 4096
    peer.sendall(struct.pack("<BI", kind, 2**32 - 1) + following)
    with caplog.at_level(logging.WARNING):
        serve_one(lane, served)
    status, reply = _read_frame(peer)
    why = (
        "hello of 4294967295 bytes is over the 512-byte limit of a lane token"
        if kind == HELLO
        else f"first frame is of kind {kind}, not a hello with a lane token"
    )
    assert (status, reply.decode()) == (REFUSED, f"UNAUTHENTICATED\n{why}")
    assert [r.getMessage() for r in caplog.records] == [f"lending lane refused a connection: {why}"]
    kept.setblocking(False)
    assert kept.recv(2 * len(following)) == following  # all of it unread: only the header was
    kept.close()
    peer.settimeout(HANG_GUARD_S)
    assert peer.recv(1) == b""  # and the lane closed the connection: nothing more was sent
    peer.close()


def test_an_expired_token_is_refused(creditor, caplog):
    engine, _, _ = creditor
    now = [0.0]
    lane = LaneServer(engine.lending, engine.pool.device, token_ttl_s=30, clock=lambda: now[0])
    try:
        token = lane.issue("debtor-a")
        now[0] = 31.0
        with caplog.at_level(logging.WARNING), pytest.raises(ConnectionError) as refused:
            LaneClient.over_unix("creditor", lane.path, token, DistKvMeter(), _refusal, 10.0)
        why = "lane token of debtor 'debtor-a' expired 1.0 s ago"
        assert str(refused.value) == f"UNAUTHENTICATED\n{why}"
        assert [r.getMessage() for r in caplog.records] == [f"lending lane refused a connection: {why}"]
        LaneClient.over_unix(
            "creditor", lane.path, lane.issue("debtor-a"), DistKvMeter(), _refusal, 10.0
        ).close()
    finally:
        lane.close()


def test_a_peer_that_sends_no_hello_is_dropped(creditor, caplog):
    engine, _, _ = creditor
    lane = LaneServer(engine.lending, engine.pool.device, hello_timeout_s=0.05)
    try:
        with socket.socket(socket.AF_UNIX) as silent, caplog.at_level(logging.WARNING):
            silent.connect(lane.path)
            silent.sendall(struct.pack("<BI", HELLO, 100) + b"x")  # then nothing more
            silent.settimeout(HANG_GUARD_S)
            assert silent.recv(1) == b""  # closed, with no answer
        assert "lending lane refused a connection: no hello within 0.05 s" in caplog.text
    finally:
        lane.close()


async def test_a_closed_lane_makes_the_creditor_unreachable(creditor, tiny_llama):
    engine, lane, address = creditor
    remote = GrpcCreditorTransport("creditor", address, engine.pool.layout)
    ids = await run(lambda: remote.allocate("debtor-a", 1))
    queries = torch.randn(1, tiny_llama.config.num_heads, tiny_llama.config.head_dim)
    segment = AttendSegment(queries, torch.tensor([0]), ids, [0])
    await run(lambda: remote.attend("debtor-a", AttendCall(0, [segment])).result())
    lane.close()
    remote._lane._socket.shutdown(socket.SHUT_RDWR)  # what the creditor's death does to it
    with pytest.raises(Unavailable, match="lending lane failed"):
        await run(lambda: remote.attend("debtor-a", AttendCall(0, [segment])).result())
    with pytest.raises(Unavailable):
        await run(lambda: remote.attend("debtor-a", AttendCall(0, [segment])).result())  # it stays failed
    remote.close()


@pytest.fixture
async def shared_creditor(tiny_llama):
    """(engine, address) of a lending worker whose pool is in shared memory, offered on its lane."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=1, worker_id="creditor", max_lent_blocks=8, shared_pool=True)
    )
    lane = LaneServer(engine.lending, engine.pool.device, shared_pool=engine.pool)
    server, address = await serve_worker(engine, "tiny", lane=lane)
    try:
        yield engine, address
    finally:
        lane.close()
        await server.stop(None)
        engine.stop()


async def test_a_shared_pool_is_written_and_attended_in_place_with_the_answers_of_the_rpcs(
    shared_creditor, tiny_llama
):
    engine, address = shared_creditor
    layout, cfg = engine.pool.layout, tiny_llama.config
    mapped = GrpcCreditorTransport("creditor", address, layout)
    over_grpc = GrpcCreditorTransport("creditor", address, layout, lane="off")
    ids = await run(lambda: mapped.allocate("debtor-a", 2))
    assert mapped._shared is not None  # the creditor's pool is mapped here
    block = layout.kv_block_tokens
    keys = torch.randn(block, layout.kv_dim, generator=torch.Generator().manual_seed(1))
    await run(
        lambda: mapped.write_async(
            "debtor-a", 1, KvRows([ids[0]] * block, torch.arange(block), keys, -keys)
        ).result()
    )

    queries = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    segment = AttendSegment(queries, torch.tensor([3, block - 1]), [ids[0]], [0])
    tail = KvRows([ids[1]], torch.tensor([0]), keys[:1] * 2, keys[:1])
    sent_before = mapped.meter.totals().remote_bytes_sent
    (in_place,) = await run(lambda: mapped.attend("debtor-a", AttendCall(1, [segment], tail)).result())
    assert mapped.meter.totals().remote_bytes_sent == sent_before  # no message for the attention
    (over_rpc,) = await run(lambda: over_grpc.attend("debtor-a", AttendCall(1, [segment])).result())
    assert torch.equal(in_place.output, over_rpc.output) and torch.equal(in_place.lse, over_rpc.lse)
    stored, values = await run(lambda: over_grpc.read("debtor-a", ids))
    assert torch.equal(stored[1, :block], keys) and torch.equal(values[1, :block], -keys)  # the creditor's
    assert torch.equal(stored[1, block], keys[0] * 2)

    theirs = await run(lambda: over_grpc.allocate("debtor-b", 1))
    with pytest.raises(PermissionDenied, match=f"block {theirs[0]} is not lent to debtor-a"):
        await run(lambda: mapped._lane.pages(theirs))  # the creditor names only our blocks' pages
    stolen = AttendSegment(queries[:1], torch.tensor([0]), theirs, [0])
    with pytest.raises(FailedPrecondition, match=f"block {theirs[0]} of creditor creditor is not lent"):
        await run(lambda: mapped.attend("debtor-a", AttendCall(0, [stolen])).result())
    await run(lambda: mapped.free("debtor-a", ids))
    with pytest.raises(FailedPrecondition, match="is not lent to this worker"):
        # forgotten once freed
        await run(lambda: mapped.attend("debtor-a", AttendCall(1, [segment])).result())
    await run(lambda: over_grpc.free("debtor-b", theirs))
    mapped.close()
    over_grpc.close()


async def test_a_debtor_on_a_shared_pool_finds_its_creditor_dead_at_its_next_call(
    shared_creditor, tiny_llama
):
    engine, address = shared_creditor
    mapped = GrpcCreditorTransport("creditor", address, engine.pool.layout)
    ids = await run(lambda: mapped.allocate("debtor-c", 1))
    queries = torch.randn(1, tiny_llama.config.num_heads, tiny_llama.config.head_dim)
    segment = AttendSegment(queries, torch.tensor([0]), ids, [0])
    await run(lambda: mapped.attend("debtor-c", AttendCall(0, [segment])).result())
    mapped._lane._socket.shutdown(socket.SHUT_RDWR)  # what the creditor's death does to it
    with pytest.raises(Unavailable, match="lending lane failed"):
        # recomputed, not read on
        await run(lambda: mapped.attend("debtor-c", AttendCall(0, [segment])).result())
    mapped.close()


def test_shared_memory_falls_back_to_the_socket_with_tls_or_off_the_cpu():
    cpu = torch.device("cpu")
    assert lane_mode("shared-memory", tls=False, device=cpu) == "shared-memory"
    assert lane_mode("shared-memory", tls=True, device=cpu) == "socket"
    assert lane_mode("shared-memory", tls=False, device=torch.device("cuda")) == "socket"
    assert lane_mode("off", tls=False, device=cpu) == "off"
    with pytest.raises(ValueError, match="--lending-lane must be one of shared-memory, socket, tcp, off"):
        lane_mode("on", tls=False, device=cpu)
