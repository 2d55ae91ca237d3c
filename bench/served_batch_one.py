"""Batch-1 decode served, as a user gets it: one request at a time through ``loramesh up``'s OpenAI
HTTP API against llama-server's ``/completion`` on the same Q4_1 GGUF (issue 27's latency case).

Both servers run side by side for the whole run; each round sends one greedy request of the same
token ids to each, alternating which goes first, streamed by the same client. A request's decode
rate is its tokens after the first over the time from the first chunk to the last, as the client
sees them (network, framing and the server's loop included); its time to first token is kept
too. The base model only, no adapter: llama-server's fastest case.

```sh
LORAMESH_LLAMA_SERVER=$LLAMA_CPP/build/bin/llama-server .venv/bin/python -m bench.served_batch_one
.venv/bin/python -m bench.served_batch_one --llama-server PATH --rounds 10 --up-args "--dtype float32"
```
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.quantized_bench import LlamaServer, cpu_name
from bench.systems.loramesh_up_system import _loramesh
from loramesh_cli.mesh_file import MeshFile
from services.model_files.base_model import default_model_path

PROMPT = [1000 + j for j in range(32)]
SSE_DATA = "data:"


def stream_rate(client: httpx.Client, path: str, body: dict, count_of) -> tuple[float, float]:
    """(decode tokens/s after the first token, seconds to the first token) of one streamed request;
    ``count_of(chunk, so_far)``: the tokens the stream has delivered after ``chunk``."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(SSE_DATA) or line[len(SSE_DATA) :].strip() == "[DONE]":
                continue
            counted = count_of(json.loads(line[len(SSE_DATA) :]), tokens)
            if counted > tokens:
                now = time.perf_counter()
                if first is None:
                    first, first_tokens = now, counted
                tokens, last = counted, now
    if first is None or tokens <= first_tokens:
        raise RuntimeError(f"{path}: the stream delivered {tokens} tokens")
    return (tokens - first_tokens) / (last - first), first - start


def openai_tokens(chunk: dict, so_far: int) -> int:
    return so_far + len((chunk.get("choices") or [{}])[0].get("token_ids") or ())


def llama_tokens(chunk: dict, so_far: int) -> int:
    return max(so_far, int(chunk.get("tokens_predicted", 0)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=os.environ.get("LORAMESH_LLAMA_SERVER"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--up-args", default="", help="extra `loramesh up` flags")
    parser.add_argument("--out", type=Path, default=Path("bench/out/served_batch_one.json"))
    args = parser.parse_args(argv)
    if args.llama_server is None:
        parser.error("--llama-server or $LORAMESH_LLAMA_SERVER is needed")
    threads = os.cpu_count() or 1
    rounds = []
    with tempfile.TemporaryDirectory(prefix="loramesh-bench-batch-one-") as state_dir:
        state = Path(state_dir)
        _loramesh(state, "up", "--detach", *shlex.split(args.up_args))
        server = LlamaServer(args.llama_server, default_model_path(), threads)
        try:
            mesh = MeshFile.read(state)
            gateway = mesh.services["gateway"]
            # A connection per request: llama-server drops kept-alive ones between requests.
            headers = {"Authorization": f"Bearer {mesh.admin_api_key}", "Connection": "close"}
            with httpx.Client(base_url=f"http://{gateway.openai_address}", headers=headers, timeout=300) as up, \
                    httpx.Client(base_url=server.url, headers={"Connection": "close"}, timeout=300) as llama:  # fmt: skip
                model = up.get("/v1/models").json()["data"][0]["id"]  # the base model comes first
                calls = {
                    "loramesh-up": lambda: stream_rate(up, "/v1/completions", {
                        "model": model, "prompt": PROMPT, "max_tokens": args.new_tokens, "ignore_eos": True,
                        "return_token_ids": True, "temperature": 0.0, "stream": True,
                    }, openai_tokens),
                    "llama-server": lambda: stream_rate(llama, "/completion", {
                        "prompt": PROMPT, "n_predict": args.new_tokens, "ignore_eos": True, "cache_prompt": False,
                        "temperature": 0.0, "stream": True,
                    }, llama_tokens),
                }  # fmt: skip
                for call in calls.values():
                    call()  # warm-up: first prefill, kernels built
                for index in range(args.rounds):
                    names = list(calls) if index % 2 == 0 else list(calls)[::-1]
                    measured = {name: calls[name]() for name in names}
                    row = {
                        name: {"decode_tok_s": rate, "ttft_s": ttft}
                        for name, (rate, ttft) in measured.items()
                    }
                    row["ratio"] = row["loramesh-up"]["decode_tok_s"] / row["llama-server"]["decode_tok_s"]
                    rounds.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            server.close()
            _loramesh(state, "down")
    ratios = [r["ratio"] for r in rounds]
    result = {
        "cpu": cpu_name(),
        "threads": threads,
        "up_args": args.up_args,
        "rounds": rounds,
        "ratio_median": statistics.median(ratios),
        "loramesh_up_median_tok_s": statistics.median(r["loramesh-up"]["decode_tok_s"] for r in rounds),
        "llama_server_median_tok_s": statistics.median(r["llama-server"]["decode_tok_s"] for r in rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
