"""``python -m bench.fuzz.idle_health_server``: a gRPC health server that does nothing else, the
loop-lag probe's control (:mod:`bench.fuzz.loop_lag`).

It prints its port on stdout, then serves until its stdin closes. It starts in a session of its
own, as ``loramesh up`` starts every service, so the kernel shares the CPU with it as with them. A
health check it answers late cannot be its own work: it is the machine stalling, or the prober.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2_grpc


def main() -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the prober closes the pipe (or goes away)
    server.stop(grace=None)


if __name__ == "__main__":
    main()
