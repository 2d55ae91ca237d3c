"""Speculative decoding served, as a user gets it: two ``loramesh up`` meshes side by side, one
``--speculative off`` and one ``--speculative ngram`` (or ``suffix``), on the q4_1 default, the
same requests sent to each in alternation through the OpenAI HTTP API.

Workloads (``bench.speculative_workloads``): the repetitive one (SQL rewrite by the ``sql`` demo
adapter, ticket summary by the bench's ``support`` adapter, a chat repeating an earlier answer) and the
non-repetitive one (the quick profile's trace, random-token prompts drawn afresh for each use).
Each round sends every workload at batch 1 (one request at a time) and at ``--concurrency``
requests at once. At batch 1 each request goes to one mesh then to the other, the order alternating
per round so that load drift falls on both. The concurrent groups go in the order A, B, B, A, each
mesh's rate pooled over its two (their tokens ÷ their wall times): whichever mesh's group came
first in a round ran 5-10% slower than when it came second (the second quiet runs of
2026-12-07: `off` at 224-250 tok/s first and 240-274 second), so one group each, in alternating
order, moved every round's ratio by that much. The repetitive requests are the same in every round (and the warm-up):
with ``suffix`` a mesh drafts them from its adapters' earlier outputs, the case of an adapter
repeating its own earlier answers.
Greedy, end of sequence ignored, streamed; every figure is as the client sees it:

- batch 1: decode tokens/s of a request (its tokens after the first ÷ the time from its first
  chunk to its last);
- concurrent: output tokens of the group ÷ the wall time from sending it to its last token.

The two meshes' tokens must be the same (lossless); the bench says whether they were, and what
the speculating worker drafted and accepted (its ``/metrics``). Each mesh runs one replica of each
service (``--up-args`` default): two whole default meshes are 18 processes on a 2-core machine.

With ``--llama-server`` (or ``$LORAMESH_LLAMA_SERVER``), llama-server on the same GGUF base runs
beside them at batch 1 (``bench.systems.llamacpp_lora_server``): the workloads' adapters converted to
GGUF LoRA files (base-model requests go to a second llama-server without adapters, its fastest
case), each batch-1 request sent to it as the same prompt token ids (a chat's rendered
by the base model's chat template, as the gateway renders it), the three systems' order rotating
per round; the bench reports each mesh's batch-1 rate against llama-server's.

    .venv/bin/python -m bench.speculative_served_bench --rounds 4
    .venv/bin/python -m bench.speculative_served_bench --mode off   # A/A: how far two off meshes measure apart
    LORAMESH_LLAMA_SERVER=$LLAMA_CPP/build/bin/llama-server .venv/bin/python -m bench.speculative_served_bench
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

import httpx

from bench.quantized_bench import cpu_name
from bench.served_batch_one import SSE_DATA
from bench.serving.profiles import QUICK
from bench.speculative_adapters import workload_adapter_dirs
from bench.speculative_workloads import WorkloadItem, non_repetitive, repetitive
from bench.systems.llamacpp_lora_server import LlamaLoraServer
from bench.systems.loramesh_up_system import _loramesh
from loramesh.client import Client
from loramesh_cli.mesh_file import MeshFile
from services.model_files.base_model import default_model_path
from services.model_files.tokenizer_loading import load_tokenizer

LEAN_MESH = "--gateways 1 --schedulers 1 --adapter-stores 1 --kv-managers 0"
LLAMA = "llama-server"
"""llama-server's key beside the modes in the batch-1 results."""
DRAFT_COUNTER = re.compile(r"^loramesh_gpu_worker_(accepted_draft|draft)_tokens_total (\S+)$", re.MULTILINE)


AGAIN = "off-again"
"""With ``--mode off``, the second ``off`` mesh's key: an A/A run, whose ratios show how far two
meshes that differ in nothing measure apart."""


@contextmanager
def mesh(mode: str, up_args: list[str]) -> Iterator[dict]:
    """A detached ``loramesh up --speculative mode`` (``off`` for :data:`AGAIN`) with the
    workloads' adapters uploaded; yields how to reach its OpenAI API."""
    with tempfile.TemporaryDirectory(prefix=f"loramesh-bench-spec-{mode}-") as state_dir:
        state = Path(state_dir)
        _loramesh(state, "up", "--detach", "--speculative", "off" if mode == AGAIN else mode, *up_args)
        try:
            info = MeshFile.read(state)
            with Client(info.services["gateway"].address, info.admin_api_key) as client:
                for name, directory in workload_adapter_dirs().items():
                    client.adapters.upload(directory, name)
            yield {
                "url": f"http://{info.services['gateway'].openai_address}",
                "headers": {"Authorization": f"Bearer {info.admin_api_key}"},
                "worker_metrics": f"http://{info.services['gpu_worker-0'].http_address}/metrics",
            }
        finally:
            _loramesh(state, "down")


def draft_counts(metrics_url: str) -> dict[str, float]:
    """The worker's drafted and accepted tokens so far ({} with speculation off)."""
    text = httpx.get(metrics_url, timeout=60).text
    return {kind: float(value) for kind, value in DRAFT_COUNTER.findall(text)}


def request(client: httpx.Client, base_model: str, item: WorkloadItem) -> dict:
    """Stream ``item``; its token ids and when its first and last chunks came."""
    body = {
        "model": item.adapter or base_model,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    if item.messages:
        path, body["messages"] = "/v1/chat/completions", list(item.messages)
    else:
        path, body["prompt"] = "/v1/completions", list(item.prompt_ids)
    start = time.perf_counter()
    tokens: list[int] = []
    stamps: list[float] = []
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            payload = line[len(SSE_DATA) :].strip()
            if not line.startswith(SSE_DATA) or payload == "[DONE]":
                continue
            ids = (json.loads(payload).get("choices") or [{}])[0].get("token_ids") or ()
            if ids:
                tokens.extend(ids)
                stamps.append(time.perf_counter())
    return {"tokens": tokens, "start": start, "first": stamps[0], "last": stamps[-1]}


def batch_one(send: Callable[[WorkloadItem], dict], items: list[WorkloadItem]) -> dict:
    """Each item alone, in turn (``send``: one streamed request's answer, as :func:`request`
    gives it): per item its decode tokens/s; and their tokens."""
    rates, tokens = {}, {}
    for item in items:
        done = send(item)
        rates[item.name] = (len(done["tokens"]) - 1) / max(done["last"] - done["first"], 1e-9)
        tokens[item.name] = done["tokens"]
    return {"decode_tok_s": rates, "tokens": tokens}


def concurrent(clients: list[httpx.Client], base_model: str, items: list[WorkloadItem]) -> dict:
    """All ``items`` at once, one client each: output tokens ÷ wall time to the last token."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(items)) as pool:
        done = list(pool.map(lambda pair: request(pair[0], base_model, pair[1]), zip(clients, items)))
    total = sum(len(d["tokens"]) for d in done)
    seconds = max(d["last"] for d in done) - start
    return {
        "tok_s": total / seconds,
        "output_tokens": total,
        "seconds": seconds,
        "tokens": {item.name: d["tokens"] for item, d in zip(items, done)},
    }


def pooled(first: dict, second: dict) -> dict:
    """One mesh's two groups of a round as one: their tokens ÷ their wall times (the first
    group's tokens kept for the comparison between meshes), each group's rate beside."""
    tokens = first["output_tokens"] + second["output_tokens"]
    return {
        "tok_s": tokens / (first["seconds"] + second["seconds"]),
        "group_tok_s": [first["tok_s"], second["tok_s"]],
        "tokens": first["tokens"],
    }


def chat_prompt_ids(items: list[WorkloadItem]) -> dict[str, list[int]]:
    """Each chat item's prompt token ids: its messages rendered by the base model's chat template
    and tokenized, as the gateway does (the workloads' adapters bring no template of their own)."""
    tokenizer = load_tokenizer().tokenizer
    return {
        item.name: tokenizer.encode(tokenizer.apply_chat_template(list(item.messages)))
        for item in items
        if item.messages
    }


def fresh_trace(concurrency: int, index: int, group: bool) -> list[WorkloadItem]:
    """The quick trace's first requests for round ``index`` (-1: the warm-up), at batch 1 or as
    the concurrent group: prompts drawn afresh for each (seed + 2 + 2·index, + 1 for the group),
    so that no mesh meets a trace prompt it served before (``suffix`` would draft a repeated
    request's whole output from its adapter's index)."""
    return non_repetitive(concurrency, seed=QUICK.workload.seed + 2 + 2 * index + group)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per repetitive request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--mode",
        default="ngram",
        help="the speculative mode set against off (off: an A/A run, off against off)",
    )
    parser.add_argument("--up-args", default=LEAN_MESH, help="extra `loramesh up` flags for both meshes")
    parser.add_argument("--out", type=Path, default=Path("bench/out/speculative_served.json"))
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("LORAMESH_LLAMA_SERVER"),
        help="llama-server built in its llama.cpp checkout: measured beside the meshes at batch 1",
    )
    args = parser.parse_args(argv)
    # A killed bench still stops its meshes (the ExitStack unwinds on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    up_args = shlex.split(args.up_args)
    modes = ("off", AGAIN if args.mode == "off" else args.mode)
    repeated = repetitive(args.tokens)
    # The repetitive concurrent group: its items cycled to fill the group.
    repeated_group = [
        WorkloadItem(f"{item.name}-{i}", item.adapter, item.max_tokens, item.messages, item.prompt_ids)
        for i, item in enumerate(repeated[j % 3] for j in range(args.concurrency))
    ]
    load = [os.getloadavg()]
    rounds = []
    llama_version = None
    with ExitStack() as stack:
        served = {mode: stack.enter_context(mesh(mode, up_args)) for mode in modes}
        clients = {
            mode: [
                stack.enter_context(httpx.Client(base_url=m["url"], headers=m["headers"], timeout=600))
                for _ in range(args.concurrency)
            ]
            for mode, m in served.items()
        }
        base_model = clients["off"][0].get("/v1/models").json()["data"][0]["id"]
        senders: dict[str, Callable[[WorkloadItem], dict]] = {
            mode: (lambda item, c=clients[mode][0]: request(c, base_model, item)) for mode in modes
        }
        if args.llama_server is not None:
            # Two servers: base-model requests go to one without adapters, since a request
            # applying none runs slower on a server holding some (llamacpp_system.py).
            servers = {
                has_adapter: stack.enter_context(
                    closing(LlamaLoraServer(args.llama_server, default_model_path(), adapters))
                )
                for has_adapter, adapters in ((True, workload_adapter_dirs()), (False, {}))
            }
            llama_version = servers[True].version
            llama_client = stack.enter_context(httpx.Client(timeout=600))
            chats = chat_prompt_ids(repeated)
            senders[LLAMA] = lambda item: servers[bool(item.adapter)].stream(
                llama_client, list(item.prompt_ids) or chats[item.name], item.adapter, item.max_tokens
            )
        for name, send in senders.items():  # warm-up: kernels built, adapters paged in
            batch_one(send, repeated)
            if name in modes:
                concurrent(clients[name], base_model, fresh_trace(args.concurrency, -1, True))
        load.append(os.getloadavg())
        drafts_before = draft_counts(served[modes[1]]["worker_metrics"])
        systems = list(senders)
        for index in range(args.rounds):
            order = modes if index % 2 == 0 else modes[::-1]
            rotated = systems[index % len(systems) :] + systems[: index % len(systems)]
            row: dict = {}
            workloads = {
                "repetitive": repeated,
                "non-repetitive": fresh_trace(args.concurrency, index, False),
            }
            groups = {
                "repetitive": repeated_group,
                "non-repetitive": fresh_trace(args.concurrency, index, True),
            }
            for name, items in workloads.items():
                by_system = row.setdefault(name, {})
                for system in rotated:
                    by_system[system] = {"batch_one": batch_one(senders[system], items)}
                runs: dict[str, list[dict]] = {mode: [] for mode in modes}
                for mode in (*order, *order[::-1]):
                    runs[mode].append(concurrent(clients[mode], base_model, groups[name]))
                for mode, (first, second) in runs.items():
                    by_system[mode]["concurrent"] = pooled(first, second)
            rounds.append(summarise_round(row, modes))
            print(json.dumps(rounds[-1]), flush=True)
        load.append(os.getloadavg())
        drafts_after = draft_counts(served[modes[1]]["worker_metrics"])
    drafts = {
        kind: drafts_after.get(kind, 0) - drafts_before.get(kind, 0) for kind in ("draft", "accepted_draft")
    }
    result = {
        "cpu": cpu_name(),
        "up_args": args.up_args,
        "modes": modes,
        "llama_server": llama_version,
        "load_average_1_5_15": load,
        "rounds": rounds,
        "medians": medians(rounds),
        "drafted": drafts["draft"],
        "accepted": drafts["accepted_draft"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    return 0


def summarise_round(row: dict, modes: tuple[str, str]) -> dict:
    """Per workload: batch-1 tok/s per item and their ratio, concurrent tok/s and its ratio, and
    whether both modes' tokens were the same."""
    off, on = modes
    summary = {}
    for name, by_mode in row.items():
        one = {mode: by_mode[mode]["batch_one"]["decode_tok_s"] for mode in modes}
        group = {mode: by_mode[mode]["concurrent"]["tok_s"] for mode in modes}
        groups = {mode: by_mode[mode]["concurrent"]["group_tok_s"] for mode in modes}
        if LLAMA in by_mode:
            one[LLAMA] = by_mode[LLAMA]["batch_one"]["decode_tok_s"]
        summary[name] = {
            "batch_one_tok_s": one,
            "batch_one_ratio": {item: one[on][item] / one[off][item] for item in one[off]},
            "concurrent_tok_s": group,
            "concurrent_group_tok_s": groups,
            "concurrent_ratio": group[on] / group[off],
            # bf16 without --deterministic: a verifying row may round differently from a decode
            # row, and a concurrent group's batches differ between the meshes anyway.
            "same_tokens": {
                kind: by_mode[off][kind]["tokens"] == by_mode[on][kind]["tokens"]
                for kind in ("batch_one", "concurrent")
            },
        }
        if LLAMA in by_mode:
            llama_tokens = by_mode[LLAMA]["batch_one"]["tokens"]
            summary[name]["batch_one_ratio_vs_llama"] = {
                mode: {item: one[mode][item] / one[LLAMA][item] for item in one[LLAMA]} for mode in modes
            }
            # Other numerics (llama.cpp's own kernels): greedy tokens may part at near-ties.
            summary[name]["llama_same_tokens_as_off"] = {
                item: tokens == by_mode[off]["batch_one"]["tokens"][item]
                for item, tokens in llama_tokens.items()
            }
    return summary


def medians(rounds: list[dict]) -> dict:
    """Per workload, the median over rounds of the batch-1 ratio (the geometric mean of its
    items' ratios in a round) and of the concurrent ratio."""
    result = {}
    for name in rounds[0]:
        per_round = [statistics.geometric_mean(r[name]["batch_one_ratio"].values()) for r in rounds]
        result[name] = {
            "batch_one_ratio": statistics.median(per_round),
            "batch_one_ratio_per_item": {
                item: statistics.median(r[name]["batch_one_ratio"][item] for r in rounds)
                for item in rounds[0][name]["batch_one_ratio"]
            },
            "concurrent_ratio": statistics.median(r[name]["concurrent_ratio"] for r in rounds),
            **versus_llama(rounds, name),
            "same_tokens": {
                kind: all(r[name]["same_tokens"][kind] for r in rounds)
                for kind in ("batch_one", "concurrent")
            },
        }
    return result


def versus_llama(rounds: list[dict], name: str) -> dict:
    """Per mode, the median over rounds of its batch-1 rate ÷ llama-server's (the geometric mean
    of the items' ratios in a round), and per item; {} without llama-server."""
    if "batch_one_ratio_vs_llama" not in rounds[0][name]:
        return {}
    modes = rounds[0][name]["batch_one_ratio_vs_llama"]
    return {
        "batch_one_ratio_vs_llama": {
            mode: statistics.median(
                statistics.geometric_mean(r[name]["batch_one_ratio_vs_llama"][mode].values()) for r in rounds
            )
            for mode in modes
        },
        "batch_one_ratio_vs_llama_per_item": {
            mode: {
                item: statistics.median(r[name]["batch_one_ratio_vs_llama"][mode][item] for r in rounds)
                for item in rounds[0][name]["batch_one_ratio_vs_llama"][mode]
            }
            for mode in modes
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
