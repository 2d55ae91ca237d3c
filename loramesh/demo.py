"""``make demo``: a local mesh with 2 workers, three sample adapters, 16 concurrent requests across
them and the base model, their outputs and a latency table, then a clean stop.

Everything goes through what a user touches: the ``loramesh`` CLI and the ``AsyncClient`` SDK.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from loramesh.async_client import AsyncClient
from loramesh.cli.main import main as loramesh
from loramesh.cli.mesh_file import MeshFile
from loramesh.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.runtime.base_model import LORA_TARGETS, load_base_model_spec

SAMPLES = {
    "sql-r8": SampleAdapterSpec(rank=8, seed=1),
    "chat-r16-mlp": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=2),
    "code-r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, rank_pattern={"o_proj": 8}, seed=3),
}
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "What do bees make?",
    "Give me a synonym for happy.",
]
MAX_TOKENS = 24


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(*argv: str) -> None:
    print("$ loramesh " + " ".join(argv), flush=True)
    if loramesh(list(argv)) != 0:
        raise SystemExit(f"demo failed at: loramesh {' '.join(argv)}")


async def one_request(client: AsyncClient, question: str, adapter: str | None) -> dict:
    started = time.perf_counter()
    first = None
    text, usage = [], None
    async for delta in client.chat_stream([{"role": "user", "content": question}], adapter=adapter,
                                          max_tokens=MAX_TOKENS):  # fmt: skip
        if first is None and delta.token_ids:
            first = time.perf_counter() - started
        text.append(delta.text)
        usage = delta.usage or usage
    total = time.perf_counter() - started
    tokens = usage.completion_tokens if usage else 0
    return {"adapter": adapter or "(base)", "question": question, "answer": "".join(text).strip(),
            "first_token_s": first or total, "total_s": total, "tokens": tokens}  # fmt: skip


async def traffic(mesh: MeshFile) -> list[dict]:
    async with AsyncClient(mesh.services["gateway"].address, mesh.admin_api_key) as client:
        adapters = [*SAMPLES, None]
        jobs = [(QUESTIONS[i % len(QUESTIONS)], adapters[i % len(adapters)]) for i in range(16)]
        return await asyncio.gather(*(one_request(client, q, a) for q, a in jobs))


def report(results: list[dict], wall_s: float) -> None:
    for r in results:
        print(f"[{r['adapter']:>15}] {r['question']}\n{'':>18}→ {r['answer'][:90]!r}")
    print(f"\n{'adapter':>15}  {'first token':>11}  {'total':>7}  {'tokens':>6}  {'tok/s':>6}")
    for r in results:
        rate = r["tokens"] / r["total_s"] if r["total_s"] else 0.0
        print(f"{r['adapter']:>15}  {r['first_token_s'] * 1000:>8.0f} ms  {r['total_s']:>5.2f} s  "
              f"{r['tokens']:>6}  {rate:>6.1f}")  # fmt: skip
    generated = sum(r["tokens"] for r in results)
    print(
        f"\n16 concurrent requests, {generated} tokens in {wall_s:.1f} s: {generated / wall_s:.1f} tokens/s overall"
    )


def main() -> int:
    spec = load_base_model_spec()
    step("start the mesh: etcd, adapter store, 2 workers, scheduler, gateway")
    run("up", "--detach", "--workers", "2", "--pool-mib", "256")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            step(f"register {len(SAMPLES)} sample PEFT adapters for {spec.name}")
            for name, sample in SAMPLES.items():
                run(
                    "adapters",
                    "upload",
                    str(write_peft_adapter(Path(tmp) / name, spec, sample)),
                    "--name",
                    name,
                )
            run("adapters", "list")
            step("one streamed completion through the CLI")
            run("generate", "--max-tokens", "16", "The three primary colours are")
            step("16 concurrent chat requests across the 3 adapters and the base model")
            started = time.perf_counter()
            results = asyncio.run(traffic(MeshFile.read()))
            report(results, time.perf_counter() - started)
            step("mesh status")
            time.sleep(1.2)  # load reports are written every second; show one taken after the traffic
            run("status")
    finally:
        step("stop the mesh")
        run("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
