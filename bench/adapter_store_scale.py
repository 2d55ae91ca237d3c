"""Scale run of the adapter store: register thousands of real-size PEFT adapters, then list,
get and fetch every one; report registration rate, fetch latency and the store's memory.

    .venv/bin/python bench/adapter_store_scale.py --adapters 2000 --ram-budget-mib 256

Adapters are for SmolLM2-135M, ranks 8 and 16 alternating, half on q/k/v/o and half also on
gate/up/down, float16. Four templates are generated with random weights; each adapter is a
template with its first 64 weights set from its index, so every adapter has distinct bytes and
its own sha256 at the template's real size. The store runs as a real process, so its resident
memory (VmRSS from /proc) is measured apart from this driver's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from grpc import aio

from loramesh_cli.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import fetch_adapter, ref_by_id, upload_adapter
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import ATTENTION_PROJECTIONS, LORA_TARGETS
from services.runtime.process import ServiceProcess

WEIGHTS = "adapter_model.safetensors"


def rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident set of a process in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def templates(root: Path) -> list[dict[str, bytes]]:
    spec = load_base_model_spec()
    kinds = [
        (8, ATTENTION_PROJECTIONS),
        (16, LORA_TARGETS),
        (8, LORA_TARGETS),
        (16, ATTENTION_PROJECTIONS),
    ]
    return [
        adapter_files(
            write_peft_adapter(root / f"t{i}", spec, SampleAdapterSpec(rank=r, target_modules=t, seed=i))
        )
        for i, (r, t) in enumerate(kinds)
    ]


def variant(template: dict[str, bytes], index: int) -> dict[str, bytes]:
    """The template with its first 64 float16 weights derived from ``index`` (distinct bytes)."""
    weights = bytearray(template[WEIGHTS])
    header_len = int.from_bytes(weights[:8], "little")
    start = 8 + header_len
    values = (np.arange(64, dtype=np.float32) + index % 9973) * 1e-4 + index * 1e-7
    weights[start : start + 128] = values.astype(np.float16).tobytes()
    return {**template, WEIGHTS: bytes(weights)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lm-scale-"))
    data_dir = work / "store"
    shutil.rmtree(data_dir, ignore_errors=True)
    bases = templates(work / "templates")
    store = ServiceProcess(
        "adapter_store",
        ["--data-dir", str(data_dir), "--ram-budget-mib", str(args.ram_budget_mib)],
        log_path=work / "store.log",
    ).start()
    await store.wait_ready(120)
    baseline_rss, _ = rss_mib(store.pid)
    result: dict = {
        "adapters": args.adapters,
        "ram_budget_mib": args.ram_budget_mib,
        "rss_at_start_mib": baseline_rss,
    }

    async with aio.insecure_channel(
        store.address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as ch:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(ch)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.adapters):
            queue.put_nowait(i)
        ids: dict[int, str] = {}
        total_bytes = 0
        peak_rss_during = 0.0

        async def uploader():
            nonlocal total_bytes, peak_rss_during
            while not queue.empty():
                i = queue.get_nowait()
                files = variant(bases[i % len(bases)], i)
                info = await upload_adapter(stub, files, f"adapter-{i:05d}", f"tenant-{i % 10}")
                ids[i] = info.id
                total_bytes += info.size_bytes
                if i % 100 == 0:
                    peak_rss_during = max(peak_rss_during, rss_mib(store.pid)[0])
                    print(f"registered {len(ids)}/{args.adapters}", flush=True)

        started = time.perf_counter()
        await asyncio.gather(*(uploader() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        result.update(
            registration_s=round(elapsed, 1),
            registrations_per_s=round(args.adapters / elapsed, 1),
            registered_mib_per_s=round(total_bytes / elapsed / 2**20, 1),
            disk_gib=round(total_bytes / 2**30, 2),
            rss_after_registration_mib=round(rss_mib(store.pid)[0], 1),
        )

        listed, token, pages = 0, "", 0
        started = time.perf_counter()
        while True:
            page = await stub.ListAdapters(pb.ListAdaptersRequest(page_size=500, page_token=token))
            listed += len(page.adapters)
            pages += 1
            token = page.next_page_token
            if not token:
                break
        result.update(listed=listed, list_pages=pages, list_all_s=round(time.perf_counter() - started, 2))

        started = time.perf_counter()
        for adapter_id in ids.values():
            await stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_id(adapter_id)))
        result["get_all_s"] = round(time.perf_counter() - started, 2)

        latencies = []
        order = list(ids.values())
        np.random.default_rng(0).shuffle(order)
        for n, adapter_id in enumerate(order):
            t0 = time.perf_counter()
            await fetch_adapter(stub, ref_by_id(adapter_id))  # raises on a checksum mismatch
            latencies.append((time.perf_counter() - t0) * 1000)
            if n % 100 == 0:
                peak_rss_during = max(peak_rss_during, rss_mib(store.pid)[0])
        stats = await stub.Stats(pb.StatsRequest())
        result.update(
            fetched_verified=len(latencies),
            fetch_p50_ms=round(statistics.median(latencies), 1),
            fetch_p99_ms=round(percentile(latencies, 99), 1),
            ram_tier_mib=round(stats.ram_bytes / 2**20, 1),
            ram_hits=stats.ram_hits,
            ram_misses=stats.ram_misses,
        )
    current, peak = rss_mib(store.pid)
    result.update(
        rss_end_mib=round(current, 1),
        rss_peak_mib=round(max(peak, peak_rss_during), 1),
        rss_peak_minus_budget_mib=round(max(peak, peak_rss_during) - args.ram_budget_mib, 1),
    )
    store.terminate()

    restarted = ServiceProcess(
        "adapter_store",
        ["--data-dir", str(data_dir), "--ram-budget-mib", str(args.ram_budget_mib)],
        log_path=work / "store-restart.log",
    ).start()
    started = time.perf_counter()
    await restarted.wait_ready(600)
    result["restart_with_sha256_verification_s"] = round(time.perf_counter() - started, 1)
    restarted.terminate()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--ram-budget-mib", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    result = asyncio.run(run(parser.parse_args()))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
