"""One prefix, every adapter, served: activated-LoRA (aLoRA) adapters behind one long system
prompt on ``loramesh up --workers 3``, through the gateway and the scheduler, and a base → checker
hand-off pipeline with an aLoRA checker against a standard LoRA one.

    .venv/bin/python -m bench.alora_fleet_bench                       # 100 adapters, 1,000 tokens
    .venv/bin/python -m bench.alora_fleet_bench --adapters 20 --recompute 4 --pipelines 2

One mesh (``loramesh up --detach --workers 3``, its defaults otherwise: prefix-aware placement,
the cluster prefix cache on, two kv_managers), torn down whatever happens. Every adapter is
uploaded through the gateway (the SDK), each its own weights (seeded random, rank 8 on q/v) and a
config PEFT's own ``LoraConfig(alora_invocation_tokens=...)`` writes; the invocation is
``<|im_start|>assistant\\nVerdict:``, which tokenizes alike wherever it stands.

**Fleet.** Adapter 1 reads the shared system prompt (``--system-tokens`` tokens of words) + a
question of its own + the invocation: it computes the prompt. Then adapters 2..N, one request at a
time, each its first, the same way. The recompute is measured in the same run under the same
conditions: ``--recompute`` more adapters, each its first request too, each with a system prompt
of its own (as long; nothing cached anywhere), interleaved evenly with the fleet's. The figure:
median TTFT of adapters 2..N ÷ the recompute's median (target ≤ 0.25). TTFT as the client sees
it: from the call to the first streamed text.

**Pipeline.** ``--pipelines`` documents of ``--document-tokens`` tokens, each twice (an aLoRA
checker and a standard LoRA checker of the same rank and targets, alternating which goes first):
the base model answers (``--answer-tokens`` greedy tokens), then the checker reads document +
answer + invocation and gives 4 tokens. End to end = both turns. The aLoRA checker's document
blocks are the base turn's KV; the standard checker's KV differs in every block.

Greedy, 4 tokens per fleet request, ``ignore_eos``. Results: ``--out`` (JSON, default
``bench/results/prefix_tier/alora_fleet.json``) and a summary on stdout. No timing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.worker_bench import machine
from loramesh.async_client import AsyncClient
from loramesh_cli.mesh_file import MeshFile
from services.model_files.base_model import load_base_model_spec
from services.model_files.tokenizer_loading import load_tokenizer

INVOCATION = "<|im_start|>assistant\nVerdict:"
TARGETS = ("q_proj", "v_proj")
RANK = 8
FLEET_TOKENS = 4
CHECK_TOKENS = 4
WORDS = (
    "claim", "evidence", "source", "report", "table", "figure", "revenue", "quarter", "policy",
    "customer", "region", "supplier", "contract", "clause", "risk", "audit", "ledger", "payment",
    "invoice", "schedule", "shipment", "warehouse", "forecast", "model", "metric", "growth",
    "margin", "cost", "budget", "review", "approval", "deadline", "owner", "team", "project",
    "milestone", "release", "defect", "incident", "outage", "latency", "service", "capacity",
    "region", "backup", "restore", "security", "access", "token", "key", "rotation", "compliance",
    "privacy", "consent", "retention", "archive", "summary", "finding", "action",
)  # fmt: skip
TIER_METRICS = ("prefix_cache_hit_blocks", "prefix_tier_remote_hit_blocks", "prefix_tier_fetched_blocks")


def words(rng: random.Random, tokenizer, tokens: int) -> str:
    """Sentences of random words, about ``tokens`` tokens long (at least that many)."""
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ". "
    return text


def fleet_prompt(system: str, number: int | str) -> str:
    """Fleet request ``number``'s prompt: the system prompt, a question of its own, the invocation."""
    return f"{system}\nQuestion {number}: is claim {number} supported?{INVOCATION}"


def write_adapter(root: Path, name: str, seed: int, invocation: list[int] | None) -> Path:
    """``name``: seeded random weights, the config written by PEFT's ``LoraConfig`` (an aLoRA
    when ``invocation`` is given)."""
    from peft import LoraConfig

    sample = SampleAdapterSpec(rank=RANK, target_modules=TARGETS, scale=0.05, seed=seed)
    directory = write_peft_adapter(root / name, load_base_model_spec(), sample)
    LoraConfig(
        r=RANK,
        lora_alpha=16,
        target_modules=list(TARGETS),
        task_type="CAUSAL_LM",
        alora_invocation_tokens=invocation,
    ).save_pretrained(str(directory))
    return directory


async def first_token(client: AsyncClient, prompt: str, adapter: str | None, max_tokens: int) -> dict:
    """One streamed request: its TTFT and whole time (s), cached prompt tokens and text."""
    started = time.perf_counter()
    ttft, text, usage = None, "", None
    async for delta in client.stream(
        prompt, adapter=adapter, max_tokens=max_tokens, temperature=0, ignore_eos=True
    ):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - started
        text += delta.text
        usage = delta.usage or usage
    return {
        "ttft_s": ttft,
        "total_s": time.perf_counter() - started,
        "cached": usage.cached_prompt_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "text": text,
    }


def worker_metrics(mesh: MeshFile) -> dict[str, dict[str, float]]:
    """Each worker's prefix counters, from its /metrics."""
    found = {}
    for name, service in sorted(mesh.services.items()):
        if not name.startswith("gpu_worker") or not service.http_address:
            continue
        with urllib.request.urlopen(f"http://{service.http_address}/metrics", timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        found[name] = {
            metric: sum(
                float(line.split()[-1]) for line in lines if line.startswith(f"loramesh_gpu_worker_{metric}")
            )
            for metric in TIER_METRICS
        }
    return found


async def fleet(client: AsyncClient, root: Path, tokenizer, args, invocation: list[int]) -> dict:
    rng = random.Random(0)
    system = words(rng, tokenizer, args.system_tokens)
    names = [f"fleet-{i}" for i in range(1, args.adapters + 1)]
    cold = [f"cold-{i}" for i in range(1, args.recompute + 1)]
    for index, name in enumerate(names + cold):
        await client.adapters.upload(write_adapter(root, name, 1000 + index, invocation), name)
    print(f"uploaded {len(names) + len(cold)} aLoRA adapters; load {os.getloadavg()[0]:.1f}", flush=True)
    order: list[tuple[str, str]] = [(name, "shared") for name in names[1:]]
    every = max(1, len(order) // max(1, len(cold)))
    for k, name in enumerate(cold):  # evenly among the fleet's, the first before adapter 2
        order.insert(k * (every + 1), (name, "recompute"))
    rows = []
    first = await first_token(client, fleet_prompt(system, 1), names[0], FLEET_TOKENS)
    rows.append({"adapter": names[0], "kind": "first", **first})
    for position, (name, kind) in enumerate(order):
        prefix = system if kind == "shared" else words(random.Random(name), tokenizer, args.system_tokens)
        prompt = fleet_prompt(prefix, name.split("-")[1])
        row = {"adapter": name, "kind": kind, **await first_token(client, prompt, name, FLEET_TOKENS)}
        rows.append(row)
        if position % 10 == 0 or kind == "recompute":
            print(f"{name:10s} {kind:9s} ttft {row['ttft_s']:.2f} s cached {row['cached']:4d} "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    shared = [r["ttft_s"] for r in rows if r["kind"] == "shared"]
    recompute = [r["ttft_s"] for r in rows if r["kind"] == "recompute"]
    return {
        "first_ttft_s": first["ttft_s"],
        "shared_median_s": statistics.median(shared),
        "shared_p90_s": statistics.quantiles(shared, n=10, method="inclusive")[-1]
        if len(shared) > 1
        else shared[0],
        "shared_max_s": max(shared),
        "recompute_median_s": statistics.median(recompute),
        "ratio_median": statistics.median(shared) / statistics.median(recompute),
        "shared_fully_cached": sum(
            r["cached"] >= args.system_tokens // 16 * 16 - 16 for r in rows if r["kind"] == "shared"
        ),
        "shared_requests": len(shared),
        "recompute_cached_max": max(r["cached"] for r in rows if r["kind"] == "recompute"),
        "rows": rows,
    }


async def pipeline(client: AsyncClient, root: Path, tokenizer, args, invocation: list[int]) -> dict:
    await client.adapters.upload(write_adapter(root, "check-alora", 7001, invocation), "check-alora")
    await client.adapters.upload(write_adapter(root, "check-lora", 7001, None), "check-lora")
    for checker in ("check-alora", "check-lora"):  # resident somewhere before the timed runs
        await first_token(client, f"Warm up.{INVOCATION}", checker, 1)
    rows = []
    for index in range(args.pipelines):
        document = words(random.Random(f"document-{index}"), tokenizer, args.document_tokens)
        checkers = ("check-alora", "check-lora") if index % 2 == 0 else ("check-lora", "check-alora")
        for checker in checkers:
            # Each checker's pipeline its own document copy: the same length, a distinct first
            # sentence, so neither finds the other's blocks.
            text = f"Document {index} for {checker}. {document}\nAnswer briefly: what does it report?"
            started = time.perf_counter()
            answer = await first_token(client, text, None, args.answer_tokens)
            check = await first_token(client, f"{text}{answer['text']}{INVOCATION}", checker, CHECK_TOKENS)
            rows.append({
                "document": index, "checker": checker, "end_to_end_s": time.perf_counter() - started,
                "base_s": answer["total_s"], "check_ttft_s": check["ttft_s"], "check_s": check["total_s"],
                "check_cached": check["cached"], "check_prompt_tokens": check["prompt_tokens"],
            })  # fmt: skip
            print(f"pipeline {index} {checker:11s} e2e {rows[-1]['end_to_end_s']:.2f} s check ttft "
                  f"{check['ttft_s']:.2f} s cached {check['cached']} load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    by = {c: [r for r in rows if r["checker"] == c] for c in ("check-alora", "check-lora")}
    median = {c: statistics.median(r["end_to_end_s"] for r in rs) for c, rs in by.items()}
    check = {c: statistics.median(r["check_ttft_s"] for r in rs) for c, rs in by.items()}
    return {
        "end_to_end_median_s": median,
        "check_ttft_median_s": check,
        "end_to_end_ratio": median["check-alora"] / median["check-lora"],
        "check_ttft_ratio": check["check-alora"] / check["check-lora"],
        "rows": rows,
    }


async def measure(mesh: MeshFile, args) -> dict:
    tokenizer = load_tokenizer().tokenizer
    invocation = tokenizer.encode(INVOCATION)
    report: dict = {"invocation_tokens": invocation}
    async with AsyncClient(
        mesh.gateway_addresses or mesh.services["gateway"].address, mesh.admin_api_key
    ) as client:
        with tempfile.TemporaryDirectory(prefix="alora-fleet-") as root:
            if args.adapters > 1:
                report["fleet"] = await fleet(client, Path(root), tokenizer, args, invocation)
                report["fleet_workers"] = worker_metrics(mesh)
            if args.pipelines > 0:
                report["pipeline"] = await pipeline(client, Path(root), tokenizer, args, invocation)
    report["workers"] = worker_metrics(mesh)
    return report


def loramesh(state: Path, *command: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state), *command], check=True
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=100, help="fleet adapters sharing the prompt")
    parser.add_argument("--recompute", type=int, default=8, help="adapters with a prompt of their own")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--pipelines", type=int, default=4, help="documents, each through both checkers")
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--up", nargs=argparse.REMAINDER, default=[], help="more loramesh up flags (last)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_tier/alora_fleet.json"))
    args = parser.parse_args(argv)
    before = os.getloadavg()
    state = Path(tempfile.mkdtemp(prefix="lm-alora-fleet-"))
    up = ["up", "--detach", "--workers", "3", *args.up]
    started = time.perf_counter()
    try:
        loramesh(state, *up)
        report = asyncio.run(measure(MeshFile.read(state), args))
    finally:
        subprocess.run(
            [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state), "down"], check=False
        )
    report |= {
        "command": "loramesh " + " ".join(up),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine(),
        "load_average_before": before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if "fleet" in report:
        f = report["fleet"]
        print(f"fleet: adapters 2..{args.adapters} median TTFT {f['shared_median_s']:.3f} s (p90 {f['shared_p90_s']:.3f}, "
              f"max {f['shared_max_s']:.3f}) vs recompute {f['recompute_median_s']:.3f} s: ratio {f['ratio_median']:.3f}; "
              f"{f['shared_fully_cached']}/{f['shared_requests']} had the system prompt cached")  # fmt: skip
    if "pipeline" in report:
        p = report["pipeline"]
        print(f"pipeline: end to end aLoRA {p['end_to_end_median_s']['check-alora']:.2f} s vs standard "
              f"{p['end_to_end_median_s']['check-lora']:.2f} s: {p['end_to_end_ratio']:.3f}; checker TTFT ratio "
              f"{p['check_ttft_ratio']:.3f}")  # fmt: skip
    print(f"workers: {report['workers']}; load {before} -> {report['load_average_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
