"""Tenant A's chat latency on a gateway, alone and while tenant B hammers it with an adapter whose
chat template loops for minutes (issue 50), side by side in one run on one local mesh.

    .venv/bin/python -m bench.template_isolation_bench [--requests 24] [--hammer 4] [--rounds 3]

A local mesh (1 float32 worker, the default 2 gateways, A's and B's keys) is started with
``loramesh up``; B uploads a PEFT adapter whose ``chat_template.jinja`` is two nested
``range(10000)`` loops of lookups, which spend the whole template budget each time. Each round runs A's load twice, alternating which goes first: A alone,
and A while B keeps ``--hammer`` chats to its looping adapter in flight on the same gateway
(each refused FAILED_PRECONDITION once its render is over the template budget). A's load is
``--requests`` chats with the base model, two at a time, 8 greedy tokens each. Reported: A's
median and p90 latency in each case (medians over rounds), their ratios, and how many of B's
chats were refused (all of them must be) and with which message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.side_by_side import load_arguments, local_mesh
from loramesh import errors
from loramesh.async_client import AsyncClient
from services.model_files.base_model import load_base_model_spec

# 10^8 lookups that miss (each makes an Undefined): minutes of CPU unbounded, and the most CPU per
# operation counted of the cases tried (about 75 ms per 100,000 on the machine of the results).
MINUTES_OF_LOOPS = (
    "{% for i in range(10000) %}{% for j in range(10000) %}{{ messages.nothing }}{% endfor %}{% endfor %}"
)
KEYS = {"sk-bench-alice": "alice", "sk-bench-bob": "bob"}
CHAT = [{"role": "user", "content": "Name three colours."}]


async def tenant_a(client: AsyncClient, requests: int) -> list[float]:
    """Seconds each of A's chats took, two in flight at a time."""
    latencies: list[float] = []
    queue = list(range(requests))

    async def lane() -> None:
        while queue:
            queue.pop()
            started = time.perf_counter()
            await client.chat(CHAT, max_tokens=8, temperature=0)
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(lane(), lane())
    return latencies


async def tenant_b(client: AsyncClient, refusals: list[str], stop: asyncio.Event) -> None:
    """One of B's lanes: chats to its looping adapter until ``stop``; each refusal's message kept."""
    while not stop.is_set():
        try:
            await client.chat(CHAT, adapter="looper", max_tokens=8)
            refusals.append("served (not refused)")
        except errors.FailedPrecondition as refused:
            refusals.append(refused.details)


async def with_b(alice: AsyncClient, bob: AsyncClient, args, refusals: list[str]) -> list[float]:
    stop = asyncio.Event()
    hammer = [asyncio.ensure_future(tenant_b(bob, refusals, stop)) for _ in range(args.hammer)]
    try:
        return await tenant_a(alice, args.requests)
    finally:
        stop.set()
        await asyncio.gather(*hammer)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


async def measure(gateway: str, args) -> dict:
    async with AsyncClient(gateway, "sk-bench-alice") as alice, AsyncClient(gateway, "sk-bench-bob") as bob:
        with tempfile.TemporaryDirectory() as root:
            adapter = write_peft_adapter(
                Path(root) / "looper", load_base_model_spec(), SampleAdapterSpec(rank=8)
            )
            (adapter / "chat_template.jinja").write_text(MINUTES_OF_LOOPS)
            await bob.adapters.upload(adapter, "looper")
        await tenant_a(alice, 4)  # warm-up: channels open, render processes started
        refusals: list[str] = []
        runs = {
            "alone": lambda: tenant_a(alice, args.requests),
            "with_b": lambda: with_b(alice, bob, args, refusals),
        }
        medians: dict[str, list[float]] = {name: [] for name in runs}
        p90s: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(args.rounds):
            for name in runs if round_index % 2 == 0 else list(runs)[::-1]:
                latencies = await runs[name]()
                medians[name].append(statistics.median(latencies))
                p90s[name].append(p90(latencies))
    median = {name: statistics.median(values) for name, values in medians.items()}
    tail = {name: statistics.median(values) for name, values in p90s.items()}
    return {
        "requests": args.requests,
        "hammer": args.hammer,
        "rounds": args.rounds,
        "a_median_s": {name: round(v, 4) for name, v in median.items()},
        "a_p90_s": {name: round(v, 4) for name, v in tail.items()},
        "median_ratio_with_b": round(median["with_b"] / median["alone"], 3),
        "p90_ratio_with_b": round(tail["with_b"] / tail["alone"], 3),
        "b_chats": len(refusals),
        "b_refusals": {message: refusals.count(message) for message in set(refusals)},
        "rounds_median_s": {name: [round(v, 4) for v in values] for name, values in medians.items()},
    }


def main() -> None:
    parser = load_arguments(__doc__.split("\n\n")[0])
    parser.set_defaults(requests=24)
    parser.add_argument("--hammer", type=int, default=4, help="B's chats kept in flight")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as keys_dir:
        keys = Path(keys_dir) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        with local_mesh(workers=1, flags=("--api-keys-file", str(keys))) as mesh:
            result = asyncio.run(measure(mesh.services["gateway"].address, args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
