"""The nemesis over the CPU overlay run pod by pod (issue 49):

``python -m bench.cluster --nodes 3 --nemesis partition,latency,loss,kill-pod,kill-node
--duration 600 --seed 1 [--deterministic] [--out DIR]``

puts the overlay up in network namespaces (bench/cluster/pods), waits until every pod is ready,
runs one seeded round (bench/cluster/nemesis.py) and prints, per fault, the operations during and
after it and the time to serving, then the checker's problems, and its verdict as the last line
(``N sent, N ok, 0 lost, 0 corrupted, ledger balanced``). Exit status 0 when the verdict holds.
Needs root and ``ip netns`` (as the runner does). With ``latency`` among the faults, the nodes
are joined by the delaying fabric (``--fabric-latency-ms``, the base latency) so a pair of nodes
can be delayed more; otherwise by a kernel bridge.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from bench.cluster.nemesis import NemesisConfig, run_round, worker_patch
from bench.cluster.pods.render import BLOB_VOLUME, RunOverlay
from bench.cluster.pods.runner import ClientPod, OverlayRun, RunConfig
from bench.cluster.schedule import NemesisKind, parse_kinds

CLIENT = "nemesis-client"
READY_GUARD_S = 900.0
"""A hang guard on the overlay getting ready (14 pods on a loaded 2-core machine), not a claim."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--nemesis", default="partition,latency,loss,kill-pod,kill-node",
                        help="comma-separated: " + ",".join(NemesisKind))  # fmt: skip
    parser.add_argument(
        "--duration", type=float, default=120.0, help="seconds of the round (faults and quiet)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="workers with batch-invariant numerics; streams judged token for token")  # fmt: skip
    parser.add_argument("--fabric-latency-ms", type=float, default=0.05,
                        help="the delaying fabric's base latency when latency faults are asked for")  # fmt: skip
    parser.add_argument("--heal-bound-s", type=float, default=600.0)
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the run's files here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.nemesis)
    except ValueError as error:
        parser.error(str(error))
    # A SIGTERM unwinds like Ctrl-C, so the run takes its pods, namespaces and fabric down (the
    # default action killed the process alone and left every pod running).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = RunConfig(
        overlay=RunOverlay(components=(BLOB_VOLUME,), patches=(worker_patch(args.deterministic),)),
        nodes=args.nodes,
        latency_ms=args.fabric_latency_ms if NemesisKind.LATENCY in kinds else 0.0,
        clients=(ClientPod(CLIENT, node=0),),
        use_built_image=False,
        stop_grace_s=5.0,
        work_dir=args.out / "overlay" if args.out else None,
    )
    with OverlayRun(config) as run:
        began = time.monotonic()
        end = began + READY_GUARD_S
        while not run.all_ready():
            if time.monotonic() > end:
                print(run.diagnosis(), file=sys.stderr)
                return 2
            time.sleep(1.0)
        print(f"overlay ready in {time.monotonic() - began:.0f} s", flush=True)
        out = args.out or run.work / "nemesis"
        result = run_round(run, NemesisConfig(kinds, args.duration, args.seed, CLIENT, out / "round",
                                              deterministic=args.deterministic, heal_bound_s=args.heal_bound_s))  # fmt: skip
        print(result.report, flush=True)
        return 0 if result.verdict.holds else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
