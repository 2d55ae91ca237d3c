"""What the delaying proxy really adds: round trips of a small message through it (a process of
its own, as the nemesis runs it) against round trips straight to the same echo server, for
each configured one-way delay, and one-way bulk throughput with and without a delay.

    python -m bench.cluster.delay_proxy_bench [--rounds 2000] [--out DIR]

Added round trip = proxied round trip - the median direct round trip (taken interleaved with the
proxied ones); it should be 2 x the configured delay plus the proxy's own cost. Writes
``results.json`` and ``results.md`` under ``--out`` (default ``bench/out/delay_proxy``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Self

from bench.cluster.delay_proxy import parse_address
from bench.out_dir import default_out

DELAYS_MS = (0.0, 0.2, 1.0, 2.0, 50.0)
BULK_BYTES = 256 << 20
PAYLOAD = b"p" * 64


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    total = 0
    while data := await reader.read(1 << 20):
        total += len(data)
    writer.write(str(total).encode())
    await writer.drain()
    writer.close()


class ProxyProcess:
    """``python -m bench.cluster.delay_proxy`` with one route per target; delay set on stdin."""

    def __init__(self, targets: list[str]):
        self.targets = targets
        self.process: asyncio.subprocess.Process | None = None
        self.addresses: list[tuple[str, int]] = []

    async def __aenter__(self) -> Self:
        routes = [arg for t in self.targets for arg in ("--route", f"127.0.0.1:0={t}")]
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.cluster.delay_proxy", *routes,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        for _ in self.targets:
            self.addresses.append(parse_address((await self.process.stdout.readline()).split()[1].decode()))
        return self

    async def set_delay_ms(self, delay_ms: float) -> None:
        self.process.stdin.write(f"delay_ms {delay_ms}\n".encode())
        await self.process.stdout.readline()  # its acknowledgement: the delay is in force

    async def __aexit__(self, *exc) -> None:
        self.process.kill()
        await self.process.wait()


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(PAYLOAD)
    await reader.readexactly(len(PAYLOAD))
    return loop.time() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _latency(proxy: ProxyProcess, echo: tuple[str, int], delay_ms: float, rounds: int) -> dict:
    await proxy.set_delay_ms(delay_ms)
    direct = await asyncio.open_connection(*echo)
    proxied = await asyncio.open_connection(*proxy.addresses[0])
    for _ in range(10):  # warm-up
        await _round_trip(*direct)
        await _round_trip(*proxied)
    direct_s, proxied_s = [], []
    for _ in range(rounds):
        direct_s.append(await _round_trip(*direct))
        proxied_s.append(await _round_trip(*proxied))
    for _, writer in (direct, proxied):
        writer.close()
    base = statistics.median(direct_s)
    added_ms = [(p - base) * 1000.0 for p in proxied_s]
    return {
        "configured_one_way_ms": delay_ms,
        "rounds": rounds,
        "direct_rtt_p50_ms": base * 1000.0,
        "direct_rtt_p99_ms": _pct(direct_s, 0.99) * 1000.0,
        "added_rtt_p50_ms": _pct(added_ms, 0.5),
        "added_rtt_p99_ms": _pct(added_ms, 0.99),
        "added_rtt_min_ms": min(added_ms),
    }


async def _bulk(address: tuple[str, int]) -> float:
    """MB/s of one connection sending ``BULK_BYTES`` one way (until the sink's count comes back)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(*address)
    block = b"b" * (1 << 20)
    start = loop.time()
    for _ in range(BULK_BYTES // len(block)):
        writer.write(block)
        await writer.drain()
    writer.write_eof()
    assert int(await reader.read()) == BULK_BYTES
    took = loop.time() - start
    writer.close()
    return BULK_BYTES / took / 1e6


def _cpu_model() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


async def run(rounds: int, slow_rounds: int) -> dict:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    sink = await asyncio.start_server(_count, "127.0.0.1", 0)
    echo_at, sink_at = (s.sockets[0].getsockname()[:2] for s in (echo, sink))
    async with echo, sink, ProxyProcess([f"{h}:{p}" for h, p in (echo_at, sink_at)]) as proxy:
        latency = [await _latency(proxy, echo_at, d, rounds if d < 10 else slow_rounds) for d in DELAYS_MS]
        throughput = {"direct": await _bulk(sink_at)}
        for delay_ms in (0.0, 50.0):
            await proxy.set_delay_ms(delay_ms)
            throughput[f"proxy {delay_ms:g} ms"] = await _bulk(proxy.addresses[1])
    return {"cpu": _cpu_model(), "latency": latency, "bulk_mb_per_s": throughput, "bulk_bytes": BULK_BYTES}


def to_markdown(results: dict) -> str:
    lines = [
        f"CPU: {results['cpu']}",
        "",
        "| configured one way (ms) | expected added round trip (ms) | added p50 (ms) | added p99 (ms) | "
        + "added min (ms) | direct round trip p50 / p99 (ms) | rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["latency"]:
        lines.append(
            f"| {r['configured_one_way_ms']:g} | {2 * r['configured_one_way_ms']:g} | "
            f"{r['added_rtt_p50_ms']:.3f} | {r['added_rtt_p99_ms']:.3f} | {r['added_rtt_min_ms']:.3f} | "
            f"{r['direct_rtt_p50_ms']:.3f} / {r['direct_rtt_p99_ms']:.3f} | {r['rounds']} |"
        )
    lines += ["", f"One-way bulk, {results['bulk_bytes'] >> 20} MiB on one connection:", ""]
    lines += [f"- {path}: {mb:.0f} MB/s" for path, mb in results["bulk_mb_per_s"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per delay under 10 ms")
    parser.add_argument("--slow-rounds", type=int, default=200, help="round trips per delay of 10 ms or more")
    parser.add_argument("--out", type=Path, default=default_out("delay_proxy"))
    args = parser.parse_args()
    results = asyncio.run(run(args.rounds, args.slow_rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
