"""The workers' load reports, read from etcd every ``--interval-s`` while a nemesis runs: one
JSONL line ``{"at": <time.monotonic()>, "loads": {instance id: report}}`` per read that etcd
answered. Run inside an etcd pod's network namespace, reading its member over loopback with the
operator's admin certificate (etcd's root role):

``python -m bench.cluster.cluster_watch --endpoints 127.0.0.1:2379 --tls CA CERT KEY --out FILE``

It reads until SIGTERM. A read etcd cannot answer (its member cut off, killed, electing) is
skipped: the checker judges the snapshots it has, and the last one is taken after every heal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from services.runtime.errors import Unavailable
from services.runtime.etcd.membership import MembershipConfig, read_loads
from services.runtime.security.tls import TLSConfig


async def watch(config: MembershipConfig, out: Path, interval_s: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    with out.open("a") as sink:
        while not stop.is_set():
            try:
                loads = await read_loads(config)
                sink.write(json.dumps({"at": time.monotonic(), "loads": loads}) + "\n")
                sink.flush()
            except (Unavailable, TimeoutError, OSError):
                pass  # a read etcd did not answer: no snapshot this time
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.cluster_watch")
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    config = MembershipConfig(etcd_endpoints=args.endpoints, tls=TLSConfig(*args.tls))
    asyncio.run(watch(config, args.out, args.interval_s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
