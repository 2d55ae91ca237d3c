"""Issue 13's long-context benchmark: DistKV-LLM borrowing against preempt+recompute, each worker
alone, and one worker with all KV local, with real processes and the real model.

Writes ``results.json`` (after every section, so a run cut short keeps what it measured),
``results.md`` and ``distkv.png`` to ``--out``.

    .venv/bin/python -m bench.distkv --profile full --out bench/out/distkv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from bench.distkv.client import WorkerClient
from bench.distkv.closed_loop import run_closed_loop
from bench.distkv.config import PROFILES, Profile
from bench.distkv.mesh import ALL_LOCAL, ALONE, BORROW, PREEMPT, Configuration, Mesh
from bench.distkv.outcome import RequestOutcome, summarize
from bench.distkv.report import write_report
from bench.distkv.search import Probe, longest_servable
from bench.distkv.traffic import ModelShape, decode_step_traffic
from bench.distkv.traffic_counters import per_step, read_counters
from bench.distkv.workload import BenchRequest, make_mix, prompt_ids
from bench.out_dir import default_out

CONTEXT_GOAL = 2.5
"""Issue 13: the mesh serves at least 2.5× one worker's longest context."""


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    flags = Path("/proc/cpuinfo").read_text()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx2": " avx2" in flags,
        "avx512_bf16": " avx512_bf16" in flags,
    }


def source_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Benchmark:
    """Runs the sections in order, saving ``results`` after each."""

    def __init__(self, profile: Profile, out: Path, log_dir: Path, commit: str):
        self.profile = profile
        self.out = out
        self.log_dir = log_dir
        self.shape = ModelShape(dtype=profile.mesh.dtype)
        self.results: dict = {
            "profile": profile.name,
            "settings": asdict(profile),
            "machine": machine(),
            "commit": commit,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load_average": {"before": load_average()},
            "longest_context": {},
            "workloads": {},
            "same_batch": {},
            "decode_overhead": {},
        }

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")

    async def run(self) -> dict:
        started = time.monotonic()
        for configuration, sections in (
            # The baselines first: a run cut short still has them; borrowing needs alone's context.
            (ALONE, (self.longest_context, self.workloads)),
            (PREEMPT, (self.workloads,)),
            (ALL_LOCAL, (self.same_batch, self.decode_overhead)),
            (BORROW, (self.longest_context, self.workloads, self.same_batch, self.decode_overhead)),
        ):
            async with Mesh(configuration, self.profile.mesh, self.log_dir) as mesh:
                clients = [WorkerClient(w.address) for w in mesh.workers]
                try:
                    for section in sections:
                        self.results["load_average"][f"{configuration.name}/{section.__name__}"] = (
                            load_average()
                        )
                        print(
                            f"[{time.monotonic() - started:6.0f} s] {configuration.name}: {section.__name__}",
                            flush=True,
                        )
                        await section(configuration, mesh, clients)
                        self.save()
                finally:
                    for client in clients:
                        await client.close()
        self.results["load_average"]["after"] = load_average()
        self.results["elapsed_s"] = round(time.monotonic() - started, 1)
        self.save()
        return self.results

    # -- sections --------------------------------------------------------------------------

    async def longest_context(
        self, configuration: Configuration, mesh: Mesh, clients: list[WorkerClient]
    ) -> None:
        """Bisect the longest context worker 0 completes, the others idle."""
        loads = await mesh.wait_quiet()
        block = self.shape.block_tokens
        own = loads[mesh.worker_ids[0]]["total_blocks"]
        lendable = sum(
            min(loads[w].get("lend_cap_blocks") or 0, loads[w]["total_blocks"]) for w in mesh.worker_ids[1:]
        ) if configuration.kv_overflow == "borrow" else 0  # fmt: skip
        # No context beyond the KV worker 0 can hold plus what the others may lend can complete.
        unservable = (own + lendable) * block + 2
        alone = self.results["longest_context"].get("alone", {}).get("longest_served")
        goal = math.ceil(CONTEXT_GOAL * alone) if alone and configuration.kv_overflow == "borrow" else None
        resolution = self.profile.search_resolution_tokens[configuration.name]
        low = own * block // 2 if goal is None else own * block

        async def probe(context: int) -> Probe:
            await mesh.wait_quiet()
            new_tokens = self.profile.probe_new_tokens
            outcome = RequestOutcome(f"probe-{context}", 0, context - new_tokens, long=context > own * block)
            prompt = prompt_ids(context - new_tokens, self.profile.seed, outcome.request_id)
            await clients[0].generate_or_detect_stuck(outcome, prompt, new_tokens, time.monotonic())
            print(
                f"    probe {context}: {outcome.status} {outcome.detail} ({outcome.finished_s:.0f} s)",
                flush=True,
            )
            return Probe(context, outcome.status == "completed", outcome.detail, round(outcome.finished_s, 1))

        search = await longest_servable(
            probe,
            low,
            unservable,
            resolution,
            self.profile.search_max_probes[configuration.name],
            first_split=goal,
        )
        self.results["longest_context"][configuration.name] = {
            "longest_served": search.longest_served,
            "shortest_refused": search.shortest_refused,
            "bound": unservable,
            "goal": goal,
            "pool_tokens": own * block,
            "probes": [asdict(p) for p in search.probes],
        }

    async def workloads(self, configuration: Configuration, mesh: Mesh, clients: list[WorkerClient]) -> None:
        profile = self.profile
        runs = self.results["workloads"].setdefault(configuration.name, {})
        for fraction in profile.long_fractions:
            requests = make_mix(
                fraction, profile.requests_per_mix, len(clients), profile.short_prompt_tokens,
                profile.long_prompt_tokens, profile.new_tokens, profile.seed,
            )  # fmt: skip
            await mesh.wait_quiet()
            outcomes, wall_s = await run_closed_loop(
                clients, requests, profile.concurrency_per_worker, profile.seed, profile.hang_guard_s
            )
            summary = summarize(outcomes, wall_s)
            print(f"    {fraction:.0%} long: {json.dumps(summary)}", flush=True)
            runs[f"{fraction:g}"] = {
                "long_fraction": fraction,
                "summary": summary,
                "outcomes": [_outcome_record(o) for o in outcomes],
            }

    def _batch(self) -> list[BenchRequest]:
        profile = self.profile
        short = sum(profile.short_prompt_tokens) // 2
        long = BenchRequest("batch-long", 0, profile.batch_long_prompt_tokens, profile.batch_new_tokens, True)
        shorts = [
            BenchRequest(f"batch-short-{i}", 0, short, profile.batch_new_tokens, False)
            for i in range(profile.batch_short_requests)
        ]
        return [long, *shorts]

    async def same_batch(self, configuration: Configuration, mesh: Mesh, clients: list[WorkerClient]) -> None:
        """One long and a few short requests sent together to worker 0."""
        await mesh.wait_quiet()
        requests = self._batch()
        outcomes, wall_s = await run_closed_loop(
            clients, requests, len(requests), self.profile.seed, self.profile.hang_guard_s
        )
        self.results["same_batch"][configuration.name] = {
            "summary": summarize(outcomes, wall_s),
            "outcomes": [_outcome_record(o) for o in outcomes],
        }

    async def decode_overhead(
        self, configuration: Configuration, mesh: Mesh, clients: list[WorkerClient]
    ) -> None:
        """The batch's long request alone on worker 0: its decode step time, where its KV was,
        and the worker's traffic counters over its decode steps when the build reports them."""
        await mesh.wait_quiet()
        request = self._batch()[0]
        outcome = RequestOutcome("overhead", 0, request.prompt_tokens, long=True)
        prompt = prompt_ids(request.prompt_tokens, self.profile.seed, outcome.request_id)
        debtor = mesh.worker_ids[0]
        generation = asyncio.ensure_future(
            clients[0].generate(outcome, prompt, request.new_tokens, time.monotonic())
        )
        while not outcome.token_times_s and not generation.done():
            await asyncio.sleep(0.05)
        first_token_wall = time.time()
        at_first = await heartbeat_after(mesh, debtor, first_token_wall)
        await generation
        at_end = await heartbeat_after(mesh, debtor, time.time())
        borrowed = {c: int(n) for c, n in (at_first.get("borrowed_blocks") or {}).items()}
        context = request.prompt_tokens + request.new_tokens // 2
        traffic = decode_step_traffic(self.shape, borrowed, context)
        before, after = read_counters(at_first), read_counters(at_end)
        self.results["decode_overhead"][configuration.name] = {
            "outcome": _outcome_record(outcome),
            "decode_step_ms": round(1000 * outcome.decode_step_s, 2) if outcome.decode_step_s else None,
            "borrowed_blocks": borrowed,
            "analytic_traffic_per_step": {
                **asdict(traffic),
                "moved": traffic.moved,
                "kv_over_moved": round(traffic.kv_over_moved, 1),
                "context_tokens": context,
            },
            "counters_per_step": per_step(before, after) if before and after else None,
        }


async def heartbeat_after(mesh: Mesh, worker_id: str, wall_time: float) -> dict:
    """The first heartbeat of ``worker_id`` written after ``wall_time`` (heartbeats come every
    second, so its counters include everything done before then)."""
    while True:
        load = (await mesh.loads()).get(worker_id, {})
        if load.get("ts", 0) > wall_time:
            return load
        await asyncio.sleep(0.2)


def _outcome_record(outcome: RequestOutcome) -> dict:
    record = asdict(outcome)
    record["token_times_s"] = [round(t, 3) for t in outcome.token_times_s]
    for key in ("started_s", "first_token_s", "finished_s"):
        if record[key] is not None:
            record[key] = round(record[key], 3)
    return record


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.distkv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    parser.add_argument("--out", default="", help="results folder (default bench/out/distkv[-quick])")
    parser.add_argument(
        "--log-dir", default=".loramesh/bench-distkv", help="the services' logs, one folder per configuration"
    )
    parser.add_argument("--commit", default="", help="source commit to record (default: git HEAD)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    name = "distkv" if profile.name == "full" else "distkv-quick"
    out = Path(args.out) if args.out else default_out(name)
    benchmark = Benchmark(profile, out, Path(args.log_dir), args.commit or source_commit())
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services too, not only this process
    results = asyncio.run(benchmark.run())
    write_report(results, out)
    print(f"done in {results['elapsed_s'] / 60:.1f} min; report: {out / 'results.md'}")
    return 0
