"""``python -m bench.cluster.pods --nodes 3 [--latency-ms X]``: the CPU overlay, pod by pod in
network namespaces, up until Ctrl-C (docs/operations.md, "Running the overlay in network
namespaces"). Needs root, ``ip netns`` and nftables; run it from the project's venv."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from bench.cluster.pods.render import BLOB_VOLUME, CPU_OVERLAY, RunOverlay
from bench.cluster.pods.runner import OverlayRun, RunConfig, RunFailed, gateway_addresses

HANG_GUARD_S = 900.0
"""Not a timing claim: a run that is not ready by then says so and stops."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster.pods", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--nodes", type=int, default=3, help="nodes the pods are dealt onto (default 3)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency between nodes")
    parser.add_argument(
        "--overlay", type=Path, default=CPU_OVERLAY, help="the overlay (default k8s/overlays/cpu)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep the run's files (logs, certificates) here"
    )
    return parser.parse_args(argv)


async def wait_ready(run: OverlayRun) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not run.all_ready():
        if time.monotonic() > deadline:
            raise RunFailed(f"not ready after {HANG_GUARD_S:.0f} s\n{run.diagnosis()}")
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = RunConfig(RunOverlay(args.overlay, components=(BLOB_VOLUME,)), nodes=args.nodes,
                       latency_ms=args.latency_ms, work_dir=args.work_dir)  # fmt: skip
    with OverlayRun(config) as run:
        print(f"run {run.run_id}: files in {run.work}; waiting for {len(run.pods)} pods", file=sys.stderr)
        try:
            asyncio.run(wait_ready(run))
        except RunFailed as error:
            print(f"the overlay does not run: {error}", file=sys.stderr)
            return 1
        assert run.secrets is not None
        ca, cert, key = run.secrets.admin_files()
        gateway = run.service("gateway")
        print(json.dumps({
            "gateway": gateway_addresses(run),
            "gateway_service": f"gateway.loramesh.svc.cluster.local -> {gateway.vip} (inside the pods)",
            "api_key": run.secrets.api_key,
            "tls": {"ca_file": str(ca), "cert_file": str(cert), "key_file": str(key), "server_name": "mesh.loramesh"},
            "pods": [s.__dict__ for s in run.status()],
        }, indent=2))  # fmt: skip
        print("up; Ctrl-C takes it all down", file=sys.stderr)
        try:
            while True:
                time.sleep(1)
                run.check()
        except KeyboardInterrupt:
            print("taking the overlay down", file=sys.stderr)
        except RunFailed as error:
            print(f"the overlay stopped running: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
