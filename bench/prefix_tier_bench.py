"""What the cluster prefix tier saves: time to first token of activated-LoRA (aLoRA) adapters
sharing one long system prompt, spread over three workers, with the prompt's KV fetched from the
worker that computed it, against recomputing it.

    .venv/bin/python -m bench.prefix_tier_bench                 # 8 adapters, 1,000-token prompt
    .venv/bin/python -m bench.prefix_tier_bench --adapters 4 --system-tokens 500

Three real Worker gRPC servers on loopback (SmolLM2-135M-Instruct fp32 in one process, one model
shared by their engines), registered in a real etcd and announcing to a real kv_manager, exactly
as ``loramesh up --workers 3`` wires them, minus the gateway and the scheduler: each request is
sent to a worker chosen round-robin (adapter 1 to worker 0, adapter 2 to worker 1, ...), one at
a time, so that its TTFT is its own. Every adapter is an aLoRA whose invocation follows the
shared system prompt, so the system prompt's blocks are base-model KV any of them may reuse.

Three setups, fresh workers each, one after the other in each round:
  recompute  no prefix cache: every request computes its whole prompt;
  local      prefix cache, tier off: a worker reuses only what it computed itself;
  tier       prefix cache, tier on (--cluster-prefix-cache on, the cost model's defaults).
The figures are the median TTFT of adapters 2..N in each setup divided by recompute's, and the
same for only the first request each other worker serves (where the tier fetches and local
recomputes). Greedy tokens of the three setups are compared (they must be identical). Results:
a markdown table on stdout and ``bench/out/prefix_tier_bench/results.json``. No timing is
asserted anywhere.

``--served DIR`` measures a running ``loramesh up --workers N`` mesh instead (its state directory,
holding ``mesh.json``; plaintext): each round, worker 0 computes a fresh shared prompt (base model),
then worker 1 serves a cold prompt of the same length (the recompute) and the shared one (fetched
with the tier on), alternating nothing else; the figure is fetched ÷ cold per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from grpc import aio

from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.worker_bench import machine
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from mesh_api.v1.types_pb2 import WorkerLoad
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import DirectorySource
from services.gpu_worker.build import local_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.memory.prefix_fetch_cost import decoder_flops_per_token
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.prefix_tier import PrefixTierSettings
from services.gpu_worker.prefix_tier_setup import start_prefix_tier
from services.gpu_worker.servicer import WorkerServicer
from services.kv_manager.config import KVManagerConfig
from services.kv_manager.service import KVManagerService
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig, list_members
from services.runtime.etcd.worker_load import worker_load_to_report
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.rpc.server import start_service
from services.runtime.security.tls import NO_TLS, add_server_port

SETUPS = {"recompute": (False, False), "local": (True, False), "tier": (True, True)}
"""Setup -> (prefix cache, cluster tier)."""
WORKERS = 3
INVOCATION = " Verdict:"
NEW_TOKENS = 4
BLOCK = 16


def write_alora(root: Path, index: int, invocation: list[int]) -> None:
    """Adapter ``a<index>``: an aLoRA (rank 8 on every projection) invoked by ``invocation``."""
    directory = write_peft_adapter(
        root / f"a{index}",
        load_base_model_spec(),
        SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, dtype="float32", scale=0.05, seed=500 + index),
    )
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "alora_invocation_tokens": invocation}))


class Mesh:
    """Three workers, their servers and registrations, for one setup."""

    def __init__(self, etcd: EtcdServer, kv_address: str, model: LlamaModel, adapters: Path):
        self.etcd, self.kv_address, self.model, self.adapters = etcd, kv_address, model, adapters
        self.parts: list = []
        self.stubs: list[worker_pb2_grpc.WorkerStub] = []
        self.tiers: list = []

    async def start(self, setup: str, round_index: int) -> None:
        prefix_cache, tier_on = SETUPS[setup]
        defaults = WorkerConfig()
        for w in range(WORKERS):
            worker_id = f"gpu_worker-{setup}{round_index}-{w}"
            engine = local_engine(
                self.model, EngineConfig(pool_mib=192, kv_block_tokens=BLOCK, prefix_cache=prefix_cache)
            )
            engine.start()
            loader = AdapterLoader(DirectorySource(self.adapters), engine, torch.float32)
            servicer = WorkerServicer()
            servicer.attach(engine, loader, {"model": "smollm2", "dtype": "float32"})
            tier = None
            if tier_on:
                tier = start_prefix_tier(
                    engine,
                    PrefixTierSettings(worker_id, "smollm2/float32/none/16", announce_interval_s=0.05),
                    lambda: (self.kv_address,),
                    prefix_fetch_mb_s=defaults.prefix_fetch_mb_s,
                    prefill_gflops=defaults.prefill_gflops,
                )
                servicer.prefix_tier = tier.tier
            server = aio.server(interceptors=[ServiceInterceptor()])
            worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
            address = f"127.0.0.1:{add_server_port(server, '127.0.0.1:0', NO_TLS)}"
            await server.start()
            registration = MemberRegistration(
                MembershipConfig(etcd_endpoints=self.etcd.endpoint),
                MemberInfo.create("gpu_worker", address, instance_id=worker_id),
                load_fn=lambda: worker_load_to_report(WorkerLoad(total_blocks=8)),
            )
            await registration.start()
            channel = aio.insecure_channel(address)
            self.stubs.append(worker_pb2_grpc.WorkerStub(channel))
            self.tiers.append(tier)
            self.parts.append((engine, server, registration, channel, tier))

    async def stop(self) -> None:
        for engine, server, registration, channel, tier in self.parts:
            if tier is not None:
                await tier.close()
            await registration.stop()
            await channel.close()
            await server.stop(None)
            engine.stop()


async def ttft(
    stub: worker_pb2_grpc.WorkerStub, prompt: list[int], adapter: str
) -> tuple[float, list[int], int]:
    """Seconds to the first token (client side), the greedy tokens, prompt tokens cached."""
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        adapter_id=adapter,
        sampling=types_pb2.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    started, first, tokens, cached = time.perf_counter(), None, [], 0
    async for reply in stub.Generate(request):
        if reply.token_ids and first is None:
            first = time.perf_counter() - started
        tokens += reply.token_ids
        cached = max(cached, reply.cached_prompt_tokens)
    return first, tokens, cached


async def run(args) -> dict:
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    invocation = loaded.tokenizer.encode(INVOCATION)
    text = (
        "You are a reviewer in a pipeline of checkers. Read the answer below, check every claim "
        "against the facts given, say which claims are unsupported, and keep to plain words. "
    ) * 80
    system = loaded.tokenizer.encode(text)[: args.system_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.adapters):
            write_alora(root / "adapters", i, invocation)
        etcd = EtcdServer(data_dir=root / "etcd")
        etcd.start()
        config = KVManagerConfig(etcd_endpoints=etcd.endpoint, instance_id="kv-bench", dgfm_interval_s=0)
        kv_host = await start_service(KVManagerService(config), config)
        results: dict = {s: {"ttft": [], "first_elsewhere": [], "tokens": {}, "cached": []} for s in SETUPS}
        try:
            for round_index in range(args.rounds):
                for setup in SETUPS:
                    mesh = Mesh(etcd, kv_host.address, model, root / "adapters")
                    await mesh.start(setup, round_index)
                    try:
                        for i in range(args.adapters):
                            question = loaded.tokenizer.encode(f"\nAnswer {i}: the sky is green on day {i}.")
                            prompt = system + question + invocation
                            stub = mesh.stubs[i % WORKERS]
                            seconds, tokens, cached = await ttft(stub, prompt, f"a{i}")
                            if i == 0 and SETUPS[setup][1]:  # let the index learn worker 0's blocks
                                await asyncio.sleep(0.5)
                            if i > 0:
                                results[setup]["ttft"].append(seconds)
                                results[setup]["cached"].append(cached)
                                if i < WORKERS:
                                    results[setup]["first_elsewhere"].append(seconds)
                            results[setup]["tokens"][f"a{i}"] = tokens
                        if SETUPS[setup][1]:
                            counters = [vars(t.tier.counters) for t in mesh.tiers]
                            results[setup].setdefault("counters", []).append(counters)
                    finally:
                        await mesh.stop()
        finally:
            await kv_host.shutdown()
            etcd.stop()
    recompute = statistics.median(results["recompute"]["ttft"])
    recompute_first = statistics.median(results["recompute"]["first_elsewhere"])
    summary = {
        setup: {
            "median_ttft_s": statistics.median(r["ttft"]),
            "ratio_to_recompute": statistics.median(r["ttft"]) / recompute,
            "first_elsewhere_median_s": statistics.median(r["first_elsewhere"]),
            "first_elsewhere_ratio": statistics.median(r["first_elsewhere"]) / recompute_first,
        }
        for setup, r in results.items()
    }
    same = all(results[s]["tokens"] == results["recompute"]["tokens"] for s in SETUPS)
    # What the cost model's two rates were here: the lane (bytes fetched ÷ seconds in fetches) and
    # the prefill (FLOPs of a recomputed prompt ÷ its TTFT, an underestimate: TTFT holds more).
    block_bytes = (
        loaded.config.num_layers * 2 * BLOCK * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    )
    fetches = [c for per_round in results["tier"].get("counters", []) for c in per_round]
    seconds = sum(c["fetch_seconds"] for c in fetches)
    fetched = sum(c["fetched_blocks"] for c in fetches)
    prompt_tokens = len(system) + 16
    return {
        "lane_mb_s": fetched * block_bytes / seconds / 1e6 if seconds else None,
        "prefill_gflops": decoder_flops_per_token(loaded.config) * prompt_tokens / recompute / 1e9,
        "args": vars(args) | {"out": str(args.out)},
        "machine": machine(),
        "load_average": os.getloadavg(),
        "summary": summary,
        "same_tokens": same,
        "raw": results,
    }


async def served(state_dir: Path, rounds: int, tokens: int) -> dict:
    """The ``--served`` rounds against the mesh whose state is in ``state_dir``."""
    mesh = json.loads((state_dir / "mesh.json").read_text())
    config = MembershipConfig(etcd_endpoints=mesh["etcd_endpoint"])
    workers = sorted(await list_members(config, "gpu_worker"), key=lambda m: m.instance_id)
    tokenizer = load_model().tokenizer
    stubs = [worker_pb2_grpc.WorkerStub(aio.insecure_channel(m.address)) for m in workers[:2]]
    rows = []
    for r in range(rounds):
        shared = tokenizer.encode(f"Round {r}. You are a careful reviewer; check each claim. " * 200)[:tokens]
        cold = tokenizer.encode(f"Round {r}. Summarise the meeting notes in plain bullets. " * 200)[:tokens]
        computed, tokens_a, _ = await ttft(stubs[0], shared, "")
        await asyncio.sleep(1.0)  # two announcement intervals: the index learns worker 0's blocks
        recomputed, _, _ = await ttft(stubs[1], cold, "")
        fetched, tokens_b, cached = await ttft(stubs[1], shared, "")
        rows.append(
            {"computed_s": computed, "cold_s": recomputed, "fetched_s": fetched, "cached": cached,
             "ratio": fetched / recomputed, "same_tokens": tokens_a == tokens_b}
        )  # fmt: skip
        print(
            f"round {r}: cold {recomputed:.2f} s, fetched {fetched:.2f} s ({cached} cached), ratio {rows[-1]['ratio']:.3f}"
        )
    return {"rounds": rows, "median_ratio": statistics.median(row["ratio"] for row in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--served", type=Path, help="a running loramesh up mesh's state directory")
    parser.add_argument("--out", type=Path, default=default_out("prefix_tier_bench") / "results.json")
    args = parser.parse_args(argv)
    before = os.getloadavg()
    if args.served is not None:
        report = asyncio.run(served(args.served, args.rounds, args.system_tokens))
        report |= {"machine": machine(), "load_average_before": before, "load_average": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(
            f"median fetched ÷ cold: {report['median_ratio']:.3f}; load {before} -> {report['load_average']}"
        )
        return 0
    report = asyncio.run(run(args))
    report["load_average_before"] = before
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(
        f"| setup | median TTFT adapters 2..{args.adapters} | × recompute | first on another worker | × recompute |"
    )
    print("|---|---|---|---|---|")
    for setup, s in report["summary"].items():
        print(
            f"| {setup} | {s['median_ttft_s'] * 1000:.0f} ms | {s['ratio_to_recompute']:.2f} | "
            f"{s['first_elsewhere_median_s'] * 1000:.0f} ms | {s['first_elsewhere_ratio']:.2f} |"
        )
    lane = f"{report['lane_mb_s']:.0f} MB/s" if report["lane_mb_s"] else "no fetch"
    print(f"lane: {lane} in fetches; prefill: {report['prefill_gflops']:.1f} GFLOP/s (recompute's TTFT)")
    print(
        f"same greedy tokens in every setup: {report['same_tokens']}; load average {before} -> {report['load_average']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
