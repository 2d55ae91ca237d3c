"""What the threaded delaying proxy really adds: ``delay_proxy_bench``'s measurement (round trips
of a 64-byte message through the proxy, a process of its own, against round trips straight to
the same echo server, interleaved; then one-way bulk throughput) run on
``bench.cluster.thread_delay_proxy``.

    python -m bench.cluster.thread_delay_proxy_bench [--rounds 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Self

from bench.cluster import delay_proxy_bench
from bench.cluster.delay_proxy import parse_address
from bench.out_dir import default_out


class ProxyProcess(delay_proxy_bench.ProxyProcess):
    """``python -m bench.cluster.thread_delay_proxy`` as a child process with ``routes``
    (``LISTEN=TARGET``): a process of its own, so its threads never wait on the caller's GIL.
    ``set_delay_ms`` sets every route's delay and returns once it is in force."""

    def __init__(self, routes: list[str]):
        super().__init__([])
        self.routes = routes

    async def __aenter__(self) -> Self:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.cluster.thread_delay_proxy",
            *(arg for route in self.routes for arg in ("--route", route)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        for _ in self.routes:
            self.addresses.append(parse_address((await self.process.stdout.readline()).split()[1].decode()))
        return self


class _EchoAndSinkProxy(ProxyProcess):
    """Constructed as ``delay_proxy_bench.run`` constructs its proxy: one route per target, each
    listening on a free loopback port."""

    def __init__(self, targets: list[str]):
        super().__init__([f"127.0.0.1:0={target}" for target in targets])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per delay under 10 ms")
    parser.add_argument("--slow-rounds", type=int, default=200, help="round trips per delay of 10 ms or more")
    parser.add_argument("--out", type=Path, default=default_out("thread_delay_proxy"))
    args = parser.parse_args()
    # delay_proxy_bench.run starts whichever ProxyProcess its module names: the same measurement,
    # this proxy.
    delay_proxy_bench.ProxyProcess = _EchoAndSinkProxy
    results = asyncio.run(delay_proxy_bench.run(args.rounds, args.slow_rounds))
    results["proxy"] = "bench.cluster.thread_delay_proxy"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(delay_proxy_bench.to_markdown(results))
    print(delay_proxy_bench.to_markdown(results))


if __name__ == "__main__":
    main()
