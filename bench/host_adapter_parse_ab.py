"""A worker's parse of a fetched adapter version into its host copy, old code against new, side by
side in one process.

    .venv/bin/python -m bench.host_adapter_parse_ab [--old-ref f8aa757] [--rounds 40] [--dtype float32]

The adapter is the publish bench's (:mod:`bench.adapter_publish_bench`): rank 16 on all seven
projections of the base model's layers, float16, 9.8 MB. It is parsed as a fetch hands it over
(1 MiB chunks, as the store sends them, its sha256 already verified) and as one buffer, by
``parse_peft_adapter`` of ``--old-ref`` (its ``host_adapter.py`` loaded from git as a module of
its own) and of the working tree, in turn each round. One torch thread, as the worker's parse
thread. The last 8 host copies of each are kept, as a worker's host cache keeps them: each parse
writes fresh memory (page faults included), not a buffer just freed.

Before timing, every factor of the new parse is checked equal (``torch.equal``, same dtype,
contiguous) to the old parse's, chunked and whole. Prints one JSON object: wall and thread CPU
time per parse, p50 and min, and the load before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.gpu_worker.lora import host_adapter as new_code
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

CHUNK = 1 << 20
KEPT = 8


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-ref", default="f8aa757", help="git ref of the code before")
    parser.add_argument("--rounds", type=int, default=40, help="parses of each kind, alternating")
    parser.add_argument("--dtype", default="float32", help="the worker's dtype")
    return parser.parse_args()


def old_module(ref: str):
    """``host_adapter.py`` as it was at ``ref``, imported under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{ref}:services/gpu_worker/lora/host_adapter.py"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="lm-old-parse-")) / "old_host_adapter.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("old_host_adapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def check_same(old, new) -> None:
    assert set(old.modules) == set(new.modules), "different modules"
    for key, factors in old.modules.items():
        mine = new.modules[key]
        for theirs, ours in ((factors.a, mine.a), (factors.b_t, mine.b_t)):
            assert ours.dtype == theirs.dtype and ours.is_contiguous() and torch.equal(ours, theirs), key
        assert mine.scale == factors.scale, key
    assert new.rows is not None and new.rows.numel() == old.rows.numel()
    assert new.content_sha256 == old.content_sha256


def timed(parse: Callable[[], object], kept: list) -> tuple[float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    kept.append(parse())
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    del kept[:-KEPT]
    return 1000 * wall, 1000 * cpu


def summary(samples: list[tuple[float, float]]) -> dict:
    walls, cpus = [w for w, _ in samples], [c for _, c in samples]
    return {
        "wall_p50_ms": round(statistics.median(walls), 2),
        "wall_min_ms": round(min(walls), 2),
        "cpu_p50_ms": round(statistics.median(cpus), 2),
        "cpu_min_ms": round(min(cpus), 2),
    }


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    old_code = old_module(args.old_ref)
    spec = load_base_model_spec()
    sample = SampleAdapterSpec(rank=16, lora_alpha=32.0, target_modules=LORA_TARGETS, seed=1000)
    directory = write_peft_adapter(tempfile.mkdtemp(prefix="lm-parse-"), spec, sample)
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    chunks = [weights[i : i + CHUNK] for i in range(0, len(weights), CHUNK)]
    digest = "0" * 64  # verified by the fetch: not hashed again by either
    inputs = {"chunks": chunks, "whole": weights}
    for data in inputs.values():
        check_same(
            old_code.parse_peft_adapter("a", config, data, dtype, digest),
            new_code.parse_peft_adapter("a", config, data, dtype, digest),
        )
    load_before = os.getloadavg()
    samples: dict[str, list[tuple[float, float]]] = {}
    kept: dict[str, list] = {}
    for _ in range(args.rounds):
        for form, data in inputs.items():
            for code, module in (("old", old_code), ("new", new_code)):
                label = f"{code} {form}"
                parse = module.parse_peft_adapter
                samples.setdefault(label, []).append(
                    timed(lambda: parse("a", config, data, dtype, digest), kept.setdefault(label, []))  # noqa: B023
                )
    result = {label: summary(values) for label, values in samples.items()}
    for form in inputs:
        old, new = result[f"old {form}"], result[f"new {form}"]
        result[f"new / old {form}"] = {
            "wall_p50": round(new["wall_p50_ms"] / old["wall_p50_ms"], 3),
            "cpu_p50": round(new["cpu_p50_ms"] / old["cpu_p50_ms"], 3),
        }
    machine = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    report = {
        "adapter_bytes": len(weights),
        "dtype": args.dtype,
        "old_ref": args.old_ref,
        "rounds": args.rounds,
    }
    report["machine"] = {
        k: [round(v, 2) for v in x] if isinstance(x, tuple) else x for k, x in machine.items()
    }
    print(json.dumps(report | result, indent=2))


if __name__ == "__main__":
    main()
