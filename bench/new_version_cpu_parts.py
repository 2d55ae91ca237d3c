"""What a new adapter version costs a worker in CPU, part by part, in one process: the parts the
publish bench's per-thread figures (``cpu_ms_per_publish_to_every_worker_by_thread``) lump
together by thread.

    .venv/bin/python -m bench.new_version_cpu_parts [--rounds 10] [--dtype float32]

The adapter is the publish bench's (:mod:`bench.adapter_publish_bench`): rank 16 on all seven
projections, float16, 9.8 MB, a new content each round. One in-process engine built as a worker
builds it (its quantized base weights, one torch thread as the mesh's workers), stepped on this
thread; the prompt is the publish bench's length (11 tokens). Each round, each part's CPU time on
the thread that does it:

- *sha256*: the fetch's check of the 1 MiB chunks (the worker's event loop);
- *parse*: ``parse_peft_adapter`` of those chunks as a CPU worker's loader calls it (the host
  copy in the file's dtype where the pool's conversion is exact) and ``Engine.add_adapter``, on
  a background side thread as the pull ahead runs it; every host copy is kept (fresh memory
  each time, as a worker's host cache);
- *page-in copy*: the preload's copy into the pool, on the copier's thread;
- *base first token*: a request without an adapter, prefill and one token (engine thread);
- *new version's first token*: the same prompt with the new version, paged in already;
- *its second first token*: the version again, with a prompt one token longer (so no step's
  LoRA calls are reused from the request before).

Prints one JSON object: p50 and min per part, the CPU model and the load before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.engine_drain import serve_to_the_end
from bench.host_adapter_parse_ab import cpu_model
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.build import build_engine
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.side_threads import side_thread_pool
from services.gpu_worker.lora.host_adapter import parse_peft_adapter
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.quantization_setting import resolve_quantization
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

CHUNK = 1 << 20
"""The store's fetch chunk."""
PROMPT_TOKENS = 11


def thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def copier_thread() -> threading.Thread | None:
    """The page-in copier's thread (started at the first copy)."""
    return next((t for t in threading.enumerate() if t.name.startswith("loramesh-page-in")), None)


def first_token_cpu_s(engine: Engine, name: str, prompt: tuple[int, ...], adapter_id: str | None) -> float:
    """This thread's CPU seconds to serve one token of ``prompt`` (the engine stepped here)."""
    request = GenerationRequest(name, prompt, SamplingParams(max_tokens=1), adapter_id)
    return serve_to_the_end(engine, [request], clock=time.thread_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    config = WorkerConfig(dtype=args.dtype, threads=1, pool_mib=1024)
    loaded = load_model(quantization=resolve_quantization(config.quantization, "cpu"))
    engine = build_engine(config, loaded, device=torch.device("cpu"), dtype=dtype, shared_pool=False)
    spec = load_base_model_spec()
    prompt = tuple(range(1000, 1000 + PROMPT_TOKENS))
    longer = (*prompt, 1000 + PROMPT_TOKENS)
    parse_thread = side_thread_pool(1, "adapter-prefetch", background=True)
    parse_native = parse_thread.submit(threading.current_thread).result()
    parts: dict[str, list[float]] = {
        k: []
        for k in (
            "sha256",
            "parse",
            "page_in_copy",
            "base_first_token",
            "new_first_token",
            "second_first_token",
        )
    }
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(-1, args.rounds):  # round -1: warm-up, not kept
            sample = SampleAdapterSpec(
                rank=16, target_modules=LORA_TARGETS, dtype="float16", seed=500 + round_
            )
            files = adapter_files(write_peft_adapter(Path(root) / f"v{round_}", spec, sample))
            weights = bytes(files["adapter_model.safetensors"])
            chunks = [weights[i : i + CHUNK] for i in range(0, len(weights), CHUNK)]
            adapter_id = f"v{round_}"
            started = time.thread_time()
            digest = hashlib.sha256()
            for chunk in chunks:
                digest.update(chunk)
            sha = digest.hexdigest()
            sample_s = {"sha256": time.thread_time() - started}

            def parse_and_add(
                adapter_id=adapter_id, config=files["adapter_config.json"], chunks=chunks, sha=sha
            ):
                engine.add_adapter(parse_peft_adapter(adapter_id, config, chunks, dtype, sha, narrow=True))

            before = thread_cpu_s(parse_native)
            parse_thread.submit(parse_and_add).result()
            sample_s["parse"] = thread_cpu_s(parse_native) - before
            sample_s["base_first_token"] = first_token_cpu_s(engine, f"b{round_}", prompt, None)
            copier = copier_thread()
            before = 0.0 if copier is None else thread_cpu_s(copier)  # none before the first copy
            engine.adapters.preload([adapter_id], engine.host_adapters)
            engine.adapters.wait(adapter_id)
            sample_s["page_in_copy"] = thread_cpu_s(copier_thread()) - before
            sample_s["new_first_token"] = first_token_cpu_s(engine, f"n{round_}", prompt, adapter_id)
            sample_s["second_first_token"] = first_token_cpu_s(engine, f"s{round_}", longer, adapter_id)
            if round_ >= 0:
                for part, seconds in sample_s.items():
                    parts[part].append(seconds)
    parse_thread.shutdown()
    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "load_before": load_before,
                "load_after": os.getloadavg(),
                "rounds": args.rounds,
                "dtype": args.dtype,
                "cpu_ms": {
                    part: {"p50": round(1e3 * statistics.median(s), 2), "min": round(1e3 * min(s), 2)}
                    for part, s in parts.items()
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
