"""The lending lane between hosts (``services/gpu_worker/distkv/transport/tcp_lane.py``): the
same-host lane's frames on a TCP connection, opened by ``OpenLendingLane``'s port and token. A
request that borrows over it, with mutual TLS on, streams the greedy tokens of one big-pool
engine; a peer without a mesh certificate is refused at the handshake; the lane's answers are
the RPCs'; a lane the creditor closed is ``Unavailable`` (the step recomputes) and is opened anew
at the next call, so a live creditor stays reachable."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import pytest
import torch
from support.one_creditor import OneCreditor, step_until
from support.polling import HANG_GUARD_S, poll_until
from support.worker_server import serve_worker

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.remote_block_allocator import RemoteBlockAllocator
from services.gpu_worker.distkv.transport.grpc_creditor_transport import GrpcCreditorTransport
from services.gpu_worker.distkv.transport.lending_lane import HELLO, LaneServer, _frame
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import Unavailable
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.tls import NO_TLS

BLOCK = 4
SMALL_POOL_MIB = 1 / 64  # tiny Llama: 16 pages of 4 tokens = 8 blocks of 2 layers = 32 tokens
DEBTOR, CREDITOR = "gpu_worker-0", "gpu_worker-2"


def engine(tiny_llama, config: EngineConfig, **kwargs) -> Engine:
    return local_engine(LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), config, **kwargs)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    identities = [f"gpu_worker/{name}" for name in (DEBTOR, CREDITOR)]
    return create_mesh_certificates(tmp_path_factory.mktemp("certs"), identities)


async def _creditor(tiny_llama, tls, port: int = 0):
    lender = engine(
        tiny_llama, EngineConfig(pool_mib=1, kv_block_tokens=BLOCK, worker_id=CREDITOR, max_lent_blocks=16)
    )
    lane = LaneServer(lender.lending, lender.pool.device, tcp_host="127.0.0.1", tls=tls)
    server, address = await serve_worker(lender, "tiny", tls, lane=lane, port=port)
    return lender, lane, server, address


@pytest.fixture
async def tls_creditor(tiny_llama, certs):
    """(engine, lane, address) of a worker lending over mutual TLS, its TCP lane too."""
    lender, lane, server, address = await _creditor(tiny_llama, certs.tls_for(f"gpu_worker/{CREDITOR}"))
    try:
        yield lender, lane, address
    finally:
        lane.close()
        await server.stop(None)


@pytest.fixture
async def creditor(tiny_llama):
    """(engine, lane, address) of a worker lending in plaintext, its TCP lane too."""
    lender, lane, server, address = await _creditor(tiny_llama, NO_TLS)
    try:
        yield lender, lane, address
    finally:
        lane.close()
        await server.stop(None)


async def test_borrowing_over_the_tcp_lane_with_mutual_tls_gives_the_tokens_of_all_local(
    tls_creditor, certs, tiny_llama
):
    lender, _, address = tls_creditor
    prompt = tuple((7 * j + 3) % 250 + 1 for j in range(40))  # 10 blocks at first: 8 local, 2 borrowed
    request = GenerationRequest("long", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    big = engine(tiny_llama, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK))
    expected: list[int] = []
    big.submit(request, lambda event: event.token_id is not None and expected.append(event.token_id))
    step_until(big, lambda: False)

    transports: list[GrpcCreditorTransport] = []

    def connect(creditor: str, address: str) -> GrpcCreditorTransport:
        tls = certs.tls_for(f"gpu_worker/{DEBTOR}")
        transports.append(
            GrpcCreditorTransport(creditor, address, debtor.pool.layout, debtor.distkv, tls=tls, lane="tcp")
        )
        return transports[-1]

    debtor = engine(
        tiny_llama,
        EngineConfig(pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id=DEBTOR, kv_overflow="borrow"),
        creditors=OneCreditor(CREDITOR, address),
        connect=connect,
    )
    tokens: list[int] = []
    debtor.submit(request, lambda event: event.token_id is not None and tokens.append(event.token_id))
    await asyncio.to_thread(step_until, debtor, lambda: DEBTOR in lender.lending.lent_to())
    assert len(tokens) < len(expected)  # mid-request, with blocks lent
    await asyncio.to_thread(step_until, debtor, lambda: False)
    assert tokens == expected
    (transport,) = transports
    assert transport._lane is not None and transport._lane.remote  # the steps took the TCP lane
    assert isinstance(transport._lane._socket, ssl.SSLSocket)
    assert lender.lending.lent_to() == {} and debtor.rm.accounting().borrowed_blocks == {}
    transport.close()


async def test_a_peer_without_a_mesh_certificate_is_refused_at_the_handshake(tls_creditor, caplog):
    _, lane, _ = tls_creditor
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    def hello_without_a_certificate() -> bytes:
        with socket.create_connection(("127.0.0.1", lane.tcp_port)) as raw:
            raw.settimeout(HANG_GUARD_S)
            try:
                with context.wrap_socket(raw) as secured:
                    secured.sendall(_frame(HELLO, lane.issue(DEBTOR).encode()))
                    return secured.recv(1)  # TLS 1.3 reports the refusal at the first read
            except (ssl.SSLError, ConnectionError):
                return b""

    with caplog.at_level(logging.WARNING):
        assert await asyncio.to_thread(hello_without_a_certificate) == b""  # no answer to the token
        await poll_until(
            lambda: asyncio.sleep(0, caplog.text),
            lambda text: "lending lane refused a connection: TLS handshake failed" in text,
            "the creditor's log of the refusal",
        )


async def test_the_tcp_lane_answers_as_the_rpcs_and_is_opened_anew_after_a_break(creditor, tiny_llama):
    lender, _, address = creditor
    layout, cfg = lender.pool.layout, tiny_llama.config
    over_tcp = GrpcCreditorTransport(CREDITOR, address, layout, lane="tcp")
    over_grpc = GrpcCreditorTransport(CREDITOR, address, layout, lane="off")
    ids = await asyncio.to_thread(over_tcp.allocate, DEBTOR, 2)
    keys = torch.randn(BLOCK, layout.kv_dim, generator=torch.Generator().manual_seed(1))
    rows = KvRows([ids[0]] * BLOCK, torch.arange(BLOCK), keys, -keys)
    await asyncio.to_thread(lambda: over_tcp.write_async(DEBTOR, 1, rows).result())
    first = over_tcp._lane
    assert first is not None and first.remote

    queries = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    call = AttendCall(1, [AttendSegment(queries, torch.tensor([1, BLOCK - 1]), [ids[0]], [0])])
    (on_lane,) = await asyncio.to_thread(lambda: over_tcp.attend(DEBTOR, call).result())
    (on_rpc,) = await asyncio.to_thread(lambda: over_grpc.attend(DEBTOR, call).result())
    assert torch.equal(on_lane.output, on_rpc.output) and torch.equal(on_lane.lse, on_rpc.lse)

    first._socket.shutdown(socket.SHUT_RDWR)  # what a reset or the creditor's death does to it
    with pytest.raises(Unavailable, match="lending lane failed"):
        await asyncio.to_thread(lambda: over_tcp.attend(DEBTOR, call).result())
    (again,) = await asyncio.to_thread(lambda: over_tcp.attend(DEBTOR, call).result())  # a new lane
    assert over_tcp._lane is not first and over_tcp._lane.remote
    assert torch.equal(again.output, on_rpc.output)
    await asyncio.to_thread(over_grpc.free, DEBTOR, ids)
    over_tcp.close()
    over_grpc.close()


async def test_a_tcp_lane_that_cannot_be_reached_leaves_the_debtor_on_grpc(creditor, tiny_llama):
    lender, lane, address = creditor
    lane.close()  # the port now refuses connections, as a NetworkPolicy's reject would
    transport = GrpcCreditorTransport(CREDITOR, address, lender.pool.layout, lane="tcp")
    ids = await asyncio.to_thread(transport.allocate, DEBTOR, 1)
    queries = torch.randn(1, tiny_llama.config.num_heads, tiny_llama.config.head_dim)
    call = AttendCall(0, [AttendSegment(queries, torch.tensor([0]), ids, [0])])
    await asyncio.to_thread(lambda: transport.attend(DEBTOR, call).result())
    assert transport._lane is None  # answered over gRPC
    await asyncio.to_thread(transport.free, DEBTOR, ids)
    transport.close()


async def test_a_creditor_restarted_at_its_address_behind_the_kept_connection_keeps_no_loan(tiny_llama):
    """A pod's container restarted in place: same worker id, same address. The debtor borrows
    from the new process over gRPC, then its kept TCP connection to the old one fails; it declares
    the creditor lost, and must release there what the new process lent it (the quiet nemesis
    once ended with 19 blocks lent to a debtor that had dropped them)."""
    old_lender, old_lane, old_server, address = await _creditor(tiny_llama, NO_TLS)
    transport = GrpcCreditorTransport(CREDITOR, address, old_lender.pool.layout, lane="tcp")
    held = RemoteBlockAllocator(DEBTOR, CREDITOR, transport)
    keys = torch.randn(BLOCK, old_lender.pool.layout.kv_dim, generator=torch.Generator().manual_seed(3))

    def rows(block) -> KvRows:
        return KvRows([block] * BLOCK, torch.arange(BLOCK), keys, -keys)

    old = await asyncio.to_thread(held.allocate, 2)
    await asyncio.to_thread(held.write, 0, rows(old[0]))
    assert transport._lane is not None and transport._lane.remote
    old_lane.close()
    await old_server.stop(None)
    port = int(address.rsplit(":", 1)[1])
    lender, lane, server, _ = await _creditor(tiny_llama, NO_TLS, port=port)
    try:
        fresh = await asyncio.to_thread(held.allocate, 3)
        assert lender.lending.lent_to() == {DEBTOR: 3}
        with pytest.raises(Unavailable):
            await asyncio.to_thread(held.write, 0, rows(fresh[0]))
        assert await asyncio.to_thread(held.creditor_lost) == sorted(b.block_id for b in old + fresh)
        await poll_until(
            lambda: asyncio.sleep(0, lender.lending.lent_to()),
            lambda lent: lent == {},
            "the new loans released",
        )
    finally:
        transport.close()
        lane.close()
        await server.stop(None)
