"""``grpc.health.v1.Health/Check`` without TLS, as the kubelet's grpc probe: exit 0 when
SERVING. ``python -m bench.cluster.pods.grpc_probe HOST:PORT [SERVICE] [TIMEOUT_S]``, run by
probes.py inside a node's network namespace."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address, service = argv[0], argv[1] if len(argv) > 1 else ""
    timeout = float(argv[2]) if len(argv) > 2 else 1.0
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            print(f"grpc: {error.code().name}: {error.details()}")
            return 1
    print(f"grpc: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
