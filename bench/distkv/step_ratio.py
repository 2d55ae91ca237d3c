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
```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.distkv.client import WorkerClient
from bench.distkv.config import MeshSettings
from bench.distkv.experiment import heartbeat_after, load_average, machine, source_commit
from bench.distkv.mesh import ALL_LOCAL, BORROW, Mesh
from bench.distkv.outcome import RequestOutcome
from bench.distkv.workload import prompt_ids

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


async def run(args: argparse.Namespace) -> dict:
    settings = replace(
        MeshSettings(),
        pool_mib=args.pool_mib,
        local_pool_mib=args.local_pool_mib,
        lend_cap_blocks=args.lend_cap_blocks,
        threads=args.threads,
        lending_lane=args.lending_lane,
    )
    log_dir = OUT / "logs"
    rounds: list[dict] = []
    async with Mesh(BORROW, settings, log_dir) as borrow, Mesh(ALL_LOCAL, settings, log_dir) as local:
        debtor = WorkerClient(borrow.workers[0].address)
        alone = WorkerClient(local.workers[0].address)
        try:
            for index in range(args.rounds):
                prompt = prompt_ids(args.prompt_tokens, args.seed, f"round-{index}")
                await borrow.wait_quiet()
                pair = {"load_before": load_average()}
                order = [("borrow", debtor), ("all_local", alone)]
                for name, client in order if index % 2 == 0 else reversed(order):
                    if name == "borrow":
                        before = await heartbeat_after(borrow, borrow.worker_ids[0], time.time())
                    pair[name] = await one_request(client, prompt, args.new_tokens, f"{name}-{index}")
                    if name == "borrow":
                        after = await heartbeat_after(borrow, borrow.worker_ids[0], time.time())
                        waited = float(after["remote_attention_s"]) - float(before["remote_attention_s"])
                        pair[name]["remote_wait_ms_per_decode_step"] = 1000 * waited / (args.new_tokens - 1)
                rounds.append(pair)
                print(json.dumps(pair), flush=True)
        finally:
            await debtor.close()
            await alone.close()
    prefill = [r["borrow"]["prefill_s"] / r["all_local"]["prefill_s"] for r in rounds]
    decode = [r["borrow"]["decode_step_s"] / r["all_local"]["decode_step_s"] for r in rounds]
    return {
        "machine": machine(),
        "python": platform.python_version(),
        "commit": source_commit(),
        "settings": vars(args),
        "rounds": rounds,
        "prefill_ratio": {"median": statistics.median(prefill), "each": prefill},
        "decode_step_ratio": {"median": statistics.median(decode), "each": decode},
    }


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
    parser.add_argument("--lending-lane", default="shared-memory", choices=["shared-memory", "socket", "off"],
                        help="every worker's --lending-lane")  # fmt: skip
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    (OUT / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("prefill_ratio", "decode_step_ratio")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
