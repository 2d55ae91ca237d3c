"""A borrowing request's prefill and decode step against the same request on a worker whose pool
holds it all (issue 28's goals: decode step ≤ 1.3×, prefill ≤ 1.5×).

Two configurations run side by side as real processes: the borrowing mesh (a kv_manager and three
workers with small pools, the request sent to worker 0, which borrows most of its KV from the
other two) and one worker with a large pool. Rounds alternate between them; each round sends a
fresh random prompt (no prefix is shared, so no cache helps either side) and measures the time
to first token (the prefill) and the mean gap between its streamed tokens (the decode step), and,
from the debtor's heartbeats, how long its decode steps waited on creditors' answers.

```sh
.venv/bin/python -m bench.distkv.step_ratio                  # 2,500-token prompts, 3 rounds
.venv/bin/python -m bench.distkv.step_ratio --prompt-tokens 1500 --rounds 2
.venv/bin/python -m bench.distkv.step_ratio --lending-lane socket   # per-layer calls, no mapped pools
.venv/bin/python -m bench.distkv.step_ratio --lending-lane off,tcp --link-delays-ms 0,0.2,1   # between nodes
```

Several lanes (``--lending-lane off,tcp``): one borrowing mesh per lane, side by side, each
round sending its prompt to each of them and to the all-local worker.

Between nodes (``--link-delays-ms``): the creditors advertise another loopback address, where
``bench.cluster.thread_delay_proxy`` forwards to them (their gRPC ports and their TCP lending
lanes' ports) with the given one-way delay, so every lending call of the debtor crosses a link
with that latency (the lanes between nodes are ``tcp`` and gRPC, ``off``: the same-host lanes
are a Unix socket and a mapped pool, which no link delays). Each round then sends its prompt to
the all-local worker once and to each borrowing mesh once per delay, the delay set before each,
and measures what the link really adds to a small round trip at each delay through the same
proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.cluster.delay_proxy_bench import _latency
from bench.cluster.thread_delay_proxy_bench import ProxyProcess
from bench.distkv.client import WorkerClient
from bench.distkv.config import MeshSettings
from bench.distkv.experiment import heartbeat_after, load_average, machine, source_commit
from bench.distkv.mesh import ALL_LOCAL, BORROW, Mesh
from bench.distkv.outcome import RequestOutcome
from bench.distkv.workload import prompt_ids
from services.gpu_worker.distkv.transport.lane_modes import LANE_MODES

OUT = Path("bench/out/distkv_step_ratio")


async def one_request(client: WorkerClient, prompt: list[int], new_tokens: int, name: str) -> dict:
    outcome = RequestOutcome(name, 0, len(prompt), long=True)
    await client.generate(outcome, prompt, new_tokens, time.monotonic())
    if outcome.status != "completed" or outcome.first_token_s is None:
        raise RuntimeError(f"{name}: {outcome.status} {outcome.detail}")
    return {
        "prefill_s": outcome.first_token_s - outcome.started_s,
        "decode_step_s": outcome.decode_step_s,
        "preemptions": outcome.preemptions,
    }


CREDITOR_HOST = "127.0.0.2"
"""The loopback address the creditors advertise with ``--link-delays-ms``: the proxy's."""
LINK_PROBE_ROUNDS = 200
"""Round trips of a 64-byte message through the proxy per delay and round."""


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _link(meshes: list[Mesh], delays_ms: list[float]):
    """The delaying proxy in front of the meshes' creditors (their RPCs and their TCP lanes) and
    the echo server its first route leads to (what :func:`bench.cluster.delay_proxy_bench._latency`
    measures with), or None without ``delays_ms``."""
    if not delays_ms:
        yield None
        return
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    host, port = echo.sockets[0].getsockname()[:2]
    routes = [f"{CREDITOR_HOST}:0={host}:{port}"]
    for mesh in meshes:
        for worker, lane_port in zip(mesh.workers[1:], mesh.lane_ports[1:], strict=True):
            routes.append(f"{CREDITOR_HOST}:{worker.port}={worker.host}:{worker.port}")
            routes.append(f"{CREDITOR_HOST}:{lane_port}={worker.host}:{lane_port}")
    async with echo, ProxyProcess(routes) as proxy:
        yield proxy, (host, port)


def _ratios(rounds: list[dict], name: str, key: str) -> dict:
    each = [r[name][key] / r["all_local"][key] for r in rounds]
    return {"median": statistics.median(each), "each": each}


def _borrowers(lanes: list[str], delays_ms: list[float]) -> dict[str, tuple[str, float | None]]:
    """Each borrowing run of a round by name: its lane and its link's delay (None: no link)."""
    runs: dict[str, tuple[str, float | None]] = {}
    for lane in lanes:
        prefix = "borrow" if len(lanes) == 1 else f"borrow-{lane}"
        for delay in delays_ms or [None]:
            runs[prefix if delay is None else f"{prefix}@{delay:g}ms"] = (lane, delay)
    return runs


async def run(args: argparse.Namespace) -> dict:
    delays_ms = args.link_delays_ms
    settings = replace(
        MeshSettings(),
        pool_mib=args.pool_mib,
        local_pool_mib=args.local_pool_mib,
        lend_cap_blocks=args.lend_cap_blocks,
        threads=args.threads,
        creditor_host=CREDITOR_HOST if delays_ms else "",
    )
    log_dir = OUT / "logs"
    rounds: list[dict] = []
    borrowers = _borrowers(args.lending_lane, delays_ms)
    async with contextlib.AsyncExitStack() as stack:
        meshes = {
            lane: await stack.enter_async_context(
                Mesh(replace(BORROW, name=f"borrow-{lane}"), replace(settings, lending_lane=lane), log_dir)
            )
            for lane in args.lending_lane
        }
        local = await stack.enter_async_context(Mesh(ALL_LOCAL, settings, log_dir))
        link = await stack.enter_async_context(_link(list(meshes.values()), delays_ms))
        debtors = {lane: WorkerClient(mesh.workers[0].address) for lane, mesh in meshes.items()}
        alone = WorkerClient(local.workers[0].address)
        try:
            for index in range(args.rounds):
                prompt = prompt_ids(args.prompt_tokens, args.seed, f"round-{index}")
                pair = {"load_before": load_average()}
                order = [*borrowers, "all_local"]
                for name in order if index % 2 == 0 else reversed(order):
                    if name == "all_local":
                        pair[name] = await one_request(alone, prompt, args.new_tokens, f"{name}-{index}")
                        continue
                    lane, delay_ms = borrowers[name]
                    borrow = meshes[lane]
                    await borrow.wait_quiet()
                    if link is not None:
                        probe = await _latency(*link, delay_ms, LINK_PROBE_ROUNDS)
                    before = await heartbeat_after(borrow, borrow.worker_ids[0], time.time())
                    pair[name] = await one_request(debtors[lane], prompt, args.new_tokens, f"{name}-{index}")
                    after = await heartbeat_after(borrow, borrow.worker_ids[0], time.time())
                    waited = float(after["remote_attention_s"]) - float(before["remote_attention_s"])
                    pair[name]["remote_wait_ms_per_decode_step"] = 1000 * waited / (args.new_tokens - 1)
                    if link is not None:
                        pair[name]["link"] = {k: probe[k] for k in ("added_rtt_p50_ms", "added_rtt_p99_ms")}
                rounds.append(pair)
                print(json.dumps(pair), flush=True)
        finally:
            for client in (*debtors.values(), alone):
                await client.close()
    return {
        "machine": machine(),
        "python": platform.python_version(),
        "commit": source_commit(),
        "settings": vars(args),
        "rounds": rounds,
        **{
            name: {
                "prefill_ratio": _ratios(rounds, name, "prefill_s"),
                "decode_step_ratio": _ratios(rounds, name, "decode_step_s"),
            }
            for name in borrowers
        },
    }


def _lanes(text: str) -> list[str]:
    lanes = [word.strip() for word in text.split(",") if word.strip()]
    unknown = [lane for lane in lanes if lane not in LANE_MODES]
    if not lanes or unknown or len(set(lanes)) < len(lanes):
        raise argparse.ArgumentTypeError(
            f"lanes must be distinct ones of {', '.join(LANE_MODES)}, got {text!r}"
        )
    return lanes


def _delays(text: str) -> list[float]:
    delays = [float(word) for word in text.split(",") if word.strip()]
    if any(not d >= 0 for d in delays):
        raise argparse.ArgumentTypeError(f"delays must be 0 or more milliseconds, got {text!r}")
    return delays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=17, help="tokens generated (16 decode steps)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-mib", type=int, default=48, help="each borrowing worker's pool")
    parser.add_argument("--local-pool-mib", type=int, default=512, help="the all-local worker's pool")
    parser.add_argument("--lend-cap-blocks", type=int, default=51, help="each creditor's lend cap")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--lending-lane", type=_lanes, default=["shared-memory"],
                        help="the workers' --lending-lane; several, comma-separated: a borrowing mesh each")  # fmt: skip
    parser.add_argument("--link-delays-ms", type=_delays, default=[],
                        help="one-way delays of the link to the creditors, comma-separated (lanes tcp and off)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.link_delays_ms and not set(args.lending_lane) <= {"tcp", "off"}:
        parser.error(
            "--link-delays-ms needs --lending-lane tcp or off: the same-host lanes do not cross the link"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    (OUT / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k.startswith("borrow")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
