"""A Worker gRPC server on loopback around an in-process engine (no model loading, no etcd)."""

from __future__ import annotations

from grpc import aio

from mesh_api.v1 import worker_pb2_grpc
from services.gpu_worker.distkv.transport.lending_lane import LaneServer
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.servicer import WorkerServicer
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.security.tls import NO_TLS, TLSConfig, add_server_port


async def serve_worker(
    engine: Engine,
    model_name: str = "tiny-llama",
    tls: TLSConfig = NO_TLS,
    lane: LaneServer | None = None,
    fence: LeaseFence | None = None,
    port: int = 0,
) -> tuple[aio.Server, str]:
    """A started server for ``engine`` (domain errors mapped to statuses) and its address;
    stop it with ``await server.stop(None)``. With ``tls``: mutual TLS and the authorization
    table enforced, as a worker of ``loramesh up --tls`` serves. ``lane``: the lending lane its
    OpenLendingLane hands out (None: none, every lending call over gRPC). ``fence``: the etcd
    lease fence it refuses new work by, as a registered worker's (None: never fenced). ``port``:
    where it listens (0: a free port; a given one: a worker restarted at its address)."""
    servicer = WorkerServicer()
    servicer.attach(engine, None, {"model": model_name, "dtype": "float32"})
    servicer.lane = lane
    servicer.lease_fence = fence
    server = aio.server(interceptors=[ServiceInterceptor(enforce_authorization=tls.enabled)])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = add_server_port(server, f"127.0.0.1:{port}", tls)
    await server.start()
    return server, f"127.0.0.1:{port}"
