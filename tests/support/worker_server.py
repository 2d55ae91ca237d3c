"""A Worker gRPC server on loopback around an in-process engine (no model loading, no etcd)."""

from __future__ import annotations

from grpc import aio

from mesh_api.v1 import worker_pb2_grpc
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.servicer import WorkerServicer
from services.runtime.interceptors import ServiceInterceptor


async def serve_worker(engine: Engine, model_name: str = "tiny-llama") -> tuple[aio.Server, str]:
    """A started server for ``engine`` (domain errors mapped to statuses) and its address;
    stop it with ``await server.stop(None)``."""
    servicer = WorkerServicer()
    servicer.attach(engine, None, {"model": model_name, "dtype": "float32"})
    server = aio.server(interceptors=[ServiceInterceptor()])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
