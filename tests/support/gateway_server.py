"""A Gateway gRPC server on loopback around a fake servicer (sync gRPC, in this process): what the
CLI tests point ``--gateway`` at."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from mesh_api.v1 import gateway_pb2_grpc


@contextlib.contextmanager
def serve_gateway(servicer: gateway_pb2_grpc.GatewayServicer) -> Iterator[str]:
    """``servicer`` served on a free loopback port; yields its address, stops the server on exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
