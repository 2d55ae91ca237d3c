"""Adapters at 10,000 (issue 30): the adapter store's registration bound by bytes, a restart that
serves at once, and what 10,000 registered adapters cost the mesh, in one run of two phases.

``bytes``
    ``--real-size`` real-size PEFT adapters for SmolLM2-135M (ranks 8 and 16 alternating, half on
    q/k/v/o and half also on gate/up/down, float16: 1.9 to 9.8 MB, 5.1 MB on average) uploaded to
    a store process, ``--concurrency`` at a time. The disk's sequential write bandwidth is measured
    with ``dd`` and fsync beside it, in the store's data directory, before and after: the
    registration rate in MB/s is reported against it, with the CPU the store (and the driver)
    spent per MB. ``--via gateway`` uploads through a gateway process instead, as the SDK does
    (its CPU per MB reported too); ``--via file`` has the store import them from ``file://``
    directories written (and flushed) beforehand, no bytes on the wire. The store's catalog is in
    an etcd the bench starts for the phase (in its work directory), its blobs in its data
    directory (``sha256/<sha256>``). Beside them, the store's disk path alone (the same weights
    hashed and written by its ``LocalDirectoryBlobs``, no service and no catalog around it), and
    the registration's work alone (the same with the store's validation, and the source read
    for ``--via file``). Then the store is restarted over what it holds and timed until it
    serves.
``scale``
    ``--adapters`` small adapters (rank 8 on q/v, ≈0.9 MB) into a store that serves a scheduler,
    a worker and a gateway (each its own process, members of one etcd): ``--s3-imports`` of them imported
    from S3 (moto's in-memory server, in this process) through ``ImportAdapter``, the rest
    uploaded. Every other one is public; ten tenants own them in turn. Reported: the upload and
    import rates; each service's resident memory per registered adapter (the slope of VmRSS
    over the second half of the uploads, each point taken once the gateway lists them all) and
    the gateway's index's own bytes per adapter (tracemalloc, in this process); the gateway's
    ``/v1/models`` latency for a tenant that may use 6,000 of the adapters; the first token of
    ``--ttft-sample`` S3-imported adapters' first request (cold: the worker pulls the adapter
    from the store, which reads it from disk, and pages it in) against their second (warm:
    resident), through the gateway's OpenAI API, streamed; paging the store;
    fetching a sample of adapters (each verified against its sha256 on its first read from disk)
    and the store's restart over all of them.

Every adapter is a template with its first 64 weights set from its index, so each has its own
bytes and sha256 at the template's real size.

    .venv/bin/python bench/adapter_store_scale.py --adapters 10000 --s3-imports 1000 --real-size 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import httpx
import numpy as np
from grpc import aio
from moto.server import ThreadedMotoServer

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import fetch_adapter, ref_by_id
from mesh_api.upload_wire import WireUploadAdapterStoreStub, WireUploadGatewayStub, upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.blobs.page_aligned import page_aligned_empty, page_aligned_join
from services.adapter_store.importers.source import WEIGHTS_FILE
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.gateway.adapter_index import AdapterIndex
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import ATTENTION_PROJECTIONS, LORA_TARGETS
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.allocator import retain_freed_memory
from services.runtime.process.ports import free_port
from services.runtime.process.process import ServiceProcess

WEIGHTS = "adapter_model.safetensors"
TENANTS = 10
BUCKET = "adapters"
API_KEY = "bench-key"
MB = 1e6
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def rss_mib(pid: int) -> float:
    """Resident set of a process in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], check=True, capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def dd_write_mb_s(directory: Path, direct: bool) -> float:
    """Sequential write of 1 GiB with fsync, as ``dd`` measures it (``oflag=direct conv=fsync``, or
    through the page cache with ``conv=fdatasync``), in MB/s."""
    target = directory / "dd.bin"
    flags = ["oflag=direct", "conv=fsync"] if direct else ["conv=fdatasync"]
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M", "count=256", *flags],
                   check=True, capture_output=True)  # fmt: skip
    elapsed = time.perf_counter() - started
    target.unlink()
    return round(256 * 4 * 2**20 / elapsed / MB, 1)


def work_alone_mb_per_s(
    directory: Path, bases: list[dict[str, bytes]], count: int, threads: int, sources: Path | None = None
) -> dict:
    """In MB/s, in this process, ``threads`` threads over ``count`` adapters' weights:

    - ``bare``: the store's disk path alone: each hashed (sha256) and written as the blob of that
      digest (staged with ``O_DIRECT`` and ``fdatasync``, renamed, the directory's ``fsync``
      shared by the renames that finish together, as in the store). No transfer, no validation,
      no catalog: what registration cannot beat on this machine whatever the service does
      around it.
    - ``with_checks``: all the work a registration must do to its bytes, still without a
      service: read from ``sources`` (``--via file``: into page-aligned memory from the page
      cache, as an import reads) or already in memory (an upload), the store's whole validation
      (header, shapes, the NaN/Inf scan), sha256, the blob and its flushes."""
    weights = [page_aligned_join([variant(bases[i % len(bases)], i)[WEIGHTS_FILE]]) for i in range(count)]
    configs = [bases[i % len(bases)]["adapter_config.json"] for i in range(count)]
    spec, limits = load_base_model_spec(), ValidationLimits()
    # One blob directory each: the same weights (the same digests) are written by both figures.
    blobs = {name: LocalDirectoryBlobs(directory / "blob-path" / name) for name in ("bare", "with_checks")}

    def bare(i: int) -> int:
        blobs["bare"].put(hashlib.sha256(weights[i]).hexdigest(), weights[i])
        blobs["bare"].flush()  # durable, as a registration's blob is before its row commits
        return len(weights[i])

    def with_checks(i: int) -> int:
        data = weights[i]
        if sources is not None:
            path = sources / f"real-{i:05d}" / WEIGHTS_FILE
            data = page_aligned_empty(path.stat().st_size)
            with path.open("rb") as stream:  # buffered: reads until full (or the end), straight in
                stream.readinto(data)
        validate_adapter(configs[i], data, spec, limits)
        blobs["with_checks"].put(hashlib.sha256(data).hexdigest(), data)
        blobs["with_checks"].flush()
        return len(data)

    rates = {}
    try:
        for name, one in (("bare", bare), ("with_checks", with_checks)):
            started = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(one, range(count)))
            rates[name] = round(total / (time.perf_counter() - started) / MB, 1)
    finally:
        for store in blobs.values():
            store.close()
        shutil.rmtree(directory / "blob-path")
    return rates


def dd_both(directory: Path) -> dict:
    return {"direct_fsync": dd_write_mb_s(directory, True), "fdatasync": dd_write_mb_s(directory, False)}


def real_size_templates(root: Path) -> list[dict[str, bytes]]:
    spec = load_base_model_spec()
    kinds = [(8, ATTENTION_PROJECTIONS), (16, LORA_TARGETS), (8, LORA_TARGETS), (16, ATTENTION_PROJECTIONS)]
    return [
        adapter_files(
            write_peft_adapter(root / f"t{i}", spec, SampleAdapterSpec(rank=r, target_modules=t, seed=i))
        )
        for i, (r, t) in enumerate(kinds)
    ]


def write_file_sources(root: Path, bases: list[dict[str, bytes]], count: int) -> None:
    """``count`` adapter directories for ``file://`` imports, flushed to disk before the store
    starts (they stay in the page cache: an import reads them from memory)."""
    for i in range(count):
        directory = root / f"real-{i:05d}"
        directory.mkdir(parents=True)
        for name, data in variant(bases[i % len(bases)], i).items():
            (directory / name).write_bytes(data)
    os.sync()


def small_template(root: Path) -> dict[str, bytes]:
    spec = load_base_model_spec()
    sample = SampleAdapterSpec(rank=8, target_modules=("q_proj", "v_proj"), seed=7)
    return adapter_files(write_peft_adapter(root / "small", spec, sample))


def variant(template: dict[str, bytes], index: int) -> dict[str, bytes]:
    """The template with its first 64 float16 weights derived from ``index`` (distinct bytes;
    one copy of the template, so the driver spends little of the CPU the store shares with it)."""
    weights = memoryview(template[WEIGHTS])
    start = 8 + int.from_bytes(weights[:8], "little")
    values = (np.arange(64, dtype=np.float32) + index % 9973) * 1e-4 + index * 1e-7
    return {
        **template,
        WEIGHTS: b"".join((weights[:start], values.astype(np.float16).tobytes(), weights[start + 128 :])),
    }


def owner_of(index: int) -> str:
    return f"tenant-{index % TENANTS}"


def visibility_of(index: int) -> int:
    """Every other adapter is public: a tenant's ``/v1/models`` lists about half of them."""
    return types_pb2.VISIBILITY_PUBLIC if index % 2 == 1 else types_pb2.VISIBILITY_PRIVATE


def visible_to_first_tenant(count: int) -> int:
    """How many of the first ``count`` adapters ``owner_of(0)`` may use (its own and the public)."""
    public = types_pb2.VISIBILITY_PUBLIC
    return sum(1 for i in range(count) if owner_of(i) == owner_of(0) or visibility_of(i) == public)


TTFT_PROMPT = "Write one sentence about the sea, the wind and a lighthouse keeper's long night."


async def first_token_s(http: httpx.AsyncClient, model: str, nonce: int) -> float:
    """Seconds from sending a streamed completion for ``model`` to its first token's chunk. The
    prompt starts with ``nonce``, so that no request finds another's prompt in the prefix cache
    (a warm request that did would skip its prefill)."""
    prompt = f"{nonce}. {TTFT_PROMPT}"
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {response.status_code} {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - started
    raise RuntimeError(f"{model}: the stream ended without a token")


LOAD_METRIC = "loramesh_gpu_worker_adapter_load_seconds"


async def adapter_loads(worker_http: str) -> dict[str, tuple[float, float]]:
    """The worker's adapter-load histogram: ``{labels: (sum of seconds, count)}`` (the cpu tier:
    pulled from the store and parsed; the gpu tier: paged into the pool)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{worker_http}/metrics")).text
    loads: dict[str, list[float]] = {}
    for line in text.splitlines():
        for index, suffix in enumerate(("_sum{", "_count{")):
            if line.startswith(LOAD_METRIC + suffix):
                labels, value = line[len(LOAD_METRIC + suffix) :].rsplit("} ", 1)
                loads.setdefault(labels, [0.0, 0.0])[index] = float(value)
    return {labels: (total, count) for labels, (total, count) in loads.items()}


async def s3_ttft(
    http: httpx.AsyncClient, worker_http: str, first_import: int, count: int, sample: int
) -> dict:
    """Cold and warm first tokens of ``sample`` adapters imported from S3 that the bench's tenant
    may use, each served once cold (never served before) and once warm, in turn; with the
    worker's mean adapter load times over the cold requests."""
    listed = (await http.get("/v1/models")).json()["data"]
    nonces = itertools.count()
    await first_token_s(http, listed[0]["id"], next(nonces))  # the base model: the engine warmed up
    models = {m["id"] for m in listed}
    chosen = []
    for i in range(first_import, first_import + count):
        name = f"a{i:05d}" if owner_of(i) == owner_of(0) else f"{owner_of(i)}/a{i:05d}"
        if name in models:
            chosen.append(name)
        if len(chosen) == sample:
            break
    cold, warm = [], []
    before = await adapter_loads(worker_http)
    for model in chosen:
        cold.append(await first_token_s(http, model, next(nonces)))
        warm.append(await first_token_s(http, model, next(nonces)))
    after = await adapter_loads(worker_http)
    mean_load_ms = {
        labels: round(1e3 * (total - before.get(labels, (0, 0))[0]) / (n - before.get(labels, (0, 0))[1]), 2)
        for labels, (total, n) in after.items()
        if n > before.get(labels, (0, 0))[1]
    }
    return {
        "worker_mean_adapter_load_ms": mean_load_ms,
        "adapters": len(chosen),
        "cold_ms": [round(1e3 * s, 1) for s in cold],
        "warm_ms": [round(1e3 * s, 1) for s in warm],
        "cold_p50_ms": round(1e3 * statistics.median(cold), 1),
        "warm_p50_ms": round(1e3 * statistics.median(warm), 1),
        "cold_over_warm_p50": round(statistics.median(cold) / statistics.median(warm), 3),
    }


TTFT_PROMPT_IDS = tuple(range(1000, 1016))
"""The worker-direct requests' prompt after its nonce: 17 token ids in all, as many as
``TTFT_PROMPT`` tokenized."""


async def worker_first_token(stub, adapter_id: str, nonce: int) -> tuple[float, float]:
    """A request straight to the worker: seconds to its first token as sent, and the engine's own
    first-token time from the request's arrival on the engine (after the adapter's pull). The
    prompt's first token is ``nonce`` (no prefix cache hit)."""
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=(nonce, *TTFT_PROMPT_IDS),
        adapter_id=adapter_id,
        sampling=types_pb2.SamplingParams(max_tokens=2),
    )
    started, first = time.perf_counter(), None
    async for reply in stub.Generate(request, timeout=60):
        if reply.token_ids and first is None:
            first = time.perf_counter() - started
        if reply.HasField("timings"):
            return first, reply.timings.first_token_ms / 1e3
    raise RuntimeError(f"{adapter_id}: the worker's stream ended without timings")


async def worker_ttft(worker_address: str, adapter_ids: list[str]) -> dict:
    """Cold then warm first tokens of ``adapter_ids`` sent to the worker itself (no gateway, no
    scheduler): what the worker's pull and page-in add, apart from the mesh's hops."""
    async with aio.insecure_channel(worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        runs = {"cold": [], "warm": []}
        nonces = itertools.count(2000)
        for adapter_id in adapter_ids:
            runs["cold"].append(await worker_first_token(stub, adapter_id, next(nonces)))
            runs["warm"].append(await worker_first_token(stub, adapter_id, next(nonces)))
    out: dict = {"adapters": len(adapter_ids)}
    for kind, pairs in runs.items():
        out[f"{kind}_p50_ms"] = round(1e3 * statistics.median(p[0] for p in pairs), 1)
        out[f"{kind}_engine_p50_ms"] = round(1e3 * statistics.median(p[1] for p in pairs), 1)
    out["cold_over_warm_p50"] = round(out["cold_p50_ms"] / out["warm_p50_ms"], 3)
    out["cold_over_warm_engine_p50"] = round(out["cold_engine_p50_ms"] / out["warm_engine_p50_ms"], 3)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_all(count: int, concurrency: int, one: Callable[[int], Awaitable[int]]) -> tuple[float, int]:
    """``one(i)`` for i in range(count), ``concurrency`` at a time: (seconds, sum of what they return)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    total = 0

    async def worker():
        nonlocal total
        while not queue.empty():
            done = await one(queue.get_nowait())
            total += done

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, total


async def index_bytes_per_adapter(count: int) -> float:
    """Python memory (tracemalloc) the gateway's adapter index holds per adapter, filled here
    with ``count`` adapters shaped as the run's: corroborates the gateway's RSS slope."""

    class Listing:
        def __init__(self, messages):
            self.messages = messages

        async def watch(self, refresh: bool):
            for message in self.messages:
                yield message
            await asyncio.Event().wait()

    infos = [
        types_pb2.AdapterInfo(id=uuid.uuid4().hex, name=f"a{i:05d}", owner=owner_of(i), visibility=visibility_of(i),
                              base_model="SmolLM2-135M-Instruct", max_rank=8, created_unix_ms=1_700_000_000_000 + i)
        for i in range(count)
    ]  # fmt: skip
    messages = [
        pb.WatchAdaptersResponse(upserted=infos[i : i + 500], synced=i + 500 >= count)
        for i in range(0, count, 500)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = AdapterIndex(Listing(messages))
    await index.usable(owner_of(0))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    await index.stop()
    return held / count


STARTED: list[Callable[[], object]] = []
"""How to stop what the bench started (each idempotent), called however a run ends: a phase that
fails part way must not leave a mesh running beside whatever is measured next."""


def start(module: str, args: list[str], log: Path, env: dict | None = None) -> ServiceProcess:
    process = ServiceProcess(module, args, log_path=log, env=env).start()
    STARTED.append(process.terminate)
    return process


async def restart_s(args: list[str], log: Path) -> float:
    """Seconds from starting a store over ``args``'s data directory until it serves."""
    store = start("adapter_store", args, log)
    started = time.perf_counter()
    await store.wait_ready(600)
    elapsed = time.perf_counter() - started
    store.terminate()
    return round(elapsed, 2)


def process_cpu(pid: int) -> tuple[float, int]:
    """User plus system CPU seconds a process has used so far, and its minor page faults."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


async def bytes_phase(args, work: Path, retain: bool = True) -> dict:
    """``retain``: the store's ``--retain-freed-memory``. The store's catalog is in an etcd of
    the phase's own, wiped with the store's data directory at its end."""
    data_dir = work / "bytes-store"
    etcd_dir = work / "bytes-etcd"
    etcd = EtcdServer(etcd_dir).start()
    STARTED.append(etcd.stop)
    store_args = ["--etcd-endpoints", etcd.endpoint, "--data-dir", str(data_dir),
                  "--ram-budget-mib", str(args.ram_budget_mib),
                  "--retain-freed-memory", str(retain).lower()]  # fmt: skip
    bases = real_size_templates(work / "templates")
    sources = work / "file-sources"
    if args.via == "file":
        write_file_sources(sources, bases, args.real_size)
        policy = work / "import-policy.json"
        policy.write_text(json.dumps({"tenants": {owner_of(0): [f"file://{sources}"]}}))
        store_args += ["--import-policy-file", str(policy)]
    store = start("adapter_store", store_args, work / "bytes-store.log")
    await store.wait_ready(120)
    measured = {"store": store}
    target, metadata = store.address, ()
    if args.via == "gateway":
        gateway = start("gateway", ["--adapter-store", store.address, "--api-keys", f"{API_KEY}={owner_of(0)}",
                                    "--openai-port", str(free_port())], work / "bytes-gateway.log")  # fmt: skip
        await gateway.wait_ready(120)
        measured["gateway"] = gateway
        target = gateway.address
        metadata = (("authorization", f"Bearer {API_KEY}"),)
    dd_before = dd_both(data_dir)
    async with aio.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        if target == store.address:
            store_stub = WireUploadAdapterStoreStub(channel)
            upload = store_stub.RegisterAdapter
        else:
            upload = WireUploadGatewayStub(channel).UploadAdapter

        async def register(i: int) -> int:
            if args.via == "file":
                request = pb.ImportAdapterRequest(uri=f"file://{sources / f'real-{i:05d}'}",
                                                  name=f"real-{i:05d}", owner=owner_of(0))  # fmt: skip
                return (await store_stub.ImportAdapter(request, timeout=120)).adapter.size_bytes
            files = variant(bases[i % len(bases)], i)
            reply = await upload(
                upload_wire(files, f"real-{i:05d}", owner_of(0)), metadata=metadata, timeout=120
            )
            return reply.adapter.size_bytes

        before = {name: process_cpu(s.pid) for name, s in measured.items()}
        driver_before = time.process_time()
        elapsed, total = await run_all(args.real_size, args.concurrency, register)
        driver_cpu = time.process_time() - driver_before
        spent = {
            name: [a - b for a, b in zip(process_cpu(s.pid), before[name])] for name, s in measured.items()
        }
    for service in measured.values():
        service.terminate()
    dd_after = dd_both(data_dir)
    alone = work_alone_mb_per_s(
        work, bases, min(args.real_size, 600), args.concurrency, sources if args.via == "file" else None
    )
    blob_path = alone["bare"]
    restart = await restart_s(store_args, work / "bytes-restart.log")
    etcd.stop()
    shutil.rmtree(etcd_dir, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(sources, ignore_errors=True)
    rate = total / elapsed / MB
    dd = {k: round((dd_before[k] + dd_after[k]) / 2, 1) for k in dd_before}
    return {
        "adapters": args.real_size,
        "concurrency": args.concurrency,
        "store_retains_freed_memory": retain,
        "via": args.via,
        "mean_adapter_mb": round(total / args.real_size / MB, 2),
        "registration_s": round(elapsed, 1),
        "registrations_per_s": round(args.real_size / elapsed, 1),
        "registered_mb_per_s": round(rate, 1),
        **{f"{name}_cpu_ms_per_mb": round(cpu * 1e3 / (total / MB), 2) for name, (cpu, _) in spent.items()},
        "driver_cpu_ms_per_mb": round(driver_cpu * 1e3 / (total / MB), 2),
        **{
            f"{name}_page_faults_per_mb": round(faults / (total / MB), 1)
            for name, (_, faults) in spent.items()
        },
        "dd_mb_per_s_before": dd_before,
        "dd_mb_per_s_after": dd_after,
        "ratio_to_dd_direct_fsync": round(rate / dd["direct_fsync"], 2),
        "blob_path_alone_mb_per_s": blob_path,
        "blob_path_alone_ratio_to_dd_direct_fsync": round(blob_path / dd["direct_fsync"], 2),
        "ratio_to_blob_path_alone": round(rate / blob_path, 2),
        "registration_work_alone_mb_per_s": alone["with_checks"],
        "registration_work_alone_ratio_to_dd_direct_fsync": round(
            alone["with_checks"] / dd["direct_fsync"], 2
        ),
        "ratio_to_registration_work_alone": round(rate / alone["with_checks"], 2),
        "ratio_to_dd_fdatasync": round(rate / dd["fdatasync"], 2),
        "restart_to_serving_s": restart,
    }


def put_s3_adapters(endpoint: str, template: dict[str, bytes], first: int, count: int) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="bench", aws_secret_access_key="bench")  # fmt: skip
    s3.create_bucket(Bucket=BUCKET)
    for i in range(first, first + count):
        for name, data in variant(template, i).items():
            s3.put_object(Bucket=BUCKET, Key=f"a{i:05d}/{name}", Body=data)


async def scale_phase(args, work: Path) -> dict:
    template = small_template(work / "templates")
    uploads = args.adapters - args.s3_imports
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    STARTED.append(moto.stop)
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    started = time.perf_counter()
    await asyncio.to_thread(put_s3_adapters, endpoint, template, uploads, args.s3_imports)
    s3_put_s = time.perf_counter() - started
    policy = work / "import-policy.json"
    policy.write_text(json.dumps({"tenants": {owner_of(t): [f"s3://{BUCKET}/"] for t in range(TENANTS)}}))
    aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1"}  # fmt: skip
    etcd = EtcdServer(work / "etcd").start()
    STARTED.append(etcd.stop)
    mesh = ["--etcd-endpoints", etcd.endpoint]
    data_dir = work / "scale-store"
    store_args = [*mesh, "--data-dir", str(data_dir), "--ram-budget-mib", str(args.ram_budget_mib),
                  "--import-policy-file", str(policy)]  # fmt: skip
    store = start("adapter_store", store_args, work / "scale-store.log", env=aws)
    await store.wait_ready(120)
    scheduler = start("scheduler", mesh, work / "scheduler.log")
    worker = start("gpu_worker", [*mesh, "--pool-mib", "256"], work / "worker.log")
    openai_port = free_port()
    gateway = start(
        "gateway", [*mesh, "--api-keys", f"{API_KEY}={owner_of(0)}", "--openai-port", str(openai_port)],
        work / "gateway.log",
    )  # fmt: skip
    for service in (scheduler, worker, gateway):
        await service.wait_ready(300)
    services = {"adapter_store": store, "gateway": gateway, "scheduler": scheduler, "gpu_worker": worker}
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{openai_port}",
                             headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip

    async def settled_rss(count: int) -> dict[str, float]:
        """Each service's RSS once the gateway lists the first ``count`` adapters (and has
        answered ``/v1/models`` over them)."""
        deadline = time.monotonic() + 120
        while len((await http.get("/v1/models")).json()["data"]) - 1 != visible_to_first_tenant(count):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not list {count} adapters in 120 s")
            await asyncio.sleep(0.2)
        return {name: rss_mib(s.pid) for name, s in services.items()}

    rss_start = await settled_rss(0)
    result: dict = {"adapters": args.adapters, "s3_imports": args.s3_imports, "uploads": uploads,
                    "s3_put_s": round(s3_put_s, 1)}  # fmt: skip
    ids: list[str] = []
    id_of: dict[str, str] = {}
    async with aio.insecure_channel(store.address, options=GRPC_OPTIONS) as channel:
        stub = WireUploadAdapterStoreStub(channel)

        async def register(i: int) -> int:
            messages = upload_wire(variant(template, i), f"a{i:05d}", owner_of(i), visibility_of(i))
            info = (await stub.RegisterAdapter(messages, timeout=120)).adapter
            ids.append(info.id)
            id_of[f"a{i:05d}"] = info.id
            return info.size_bytes

        async def import_one(i: int) -> int:
            i += uploads
            request = pb.ImportAdapterRequest(uri=f"s3://{BUCKET}/a{i:05d}", name=f"a{i:05d}", owner=owner_of(i),
                                              visibility=visibility_of(i))  # fmt: skip
            reply = await stub.ImportAdapter(request, timeout=300)
            ids.append(reply.adapter.id)
            id_of[f"a{i:05d}"] = reply.adapter.id
            return reply.adapter.size_bytes

        half = uploads // 2
        first, size = await run_all(half, args.concurrency, register)
        rss_half = await settled_rss(half)
        second, more = await run_all(uploads - half, args.concurrency, lambda i: register(half + i))
        elapsed, total = first + second, size + more
        rss_uploaded = await settled_rss(uploads)
        result.update(upload_s=round(elapsed, 1), uploads_per_s=round(uploads / elapsed, 1),
                      upload_mb_per_s=round(total / elapsed / MB, 1))  # fmt: skip
        elapsed, total = await run_all(args.s3_imports, args.concurrency, import_one)
        result.update(import_s=round(elapsed, 1), imports_per_s=round(args.s3_imports / elapsed, 1),
                      import_mb_per_s=round(total / elapsed / MB, 1))  # fmt: skip
        rss_end = await settled_rss(args.adapters)
        if args.ttft_sample:
            result["s3_first_token"] = await s3_ttft(
                http, worker.http_address, uploads, args.s3_imports, args.ttft_sample
            )
            # Others imported from S3, never served yet: the same, straight to the worker.
            unserved = [id_of[f"a{i:05d}"] for i in range(args.adapters - args.ttft_sample, args.adapters)]
            result["s3_first_token_worker_direct"] = await worker_ttft(worker.address, unserved)
        listed = len((await http.get("/v1/models")).json()["data"]) - 1  # the base model first
        latencies = []
        for _ in range(args.list_rounds):
            t0 = time.perf_counter()
            await http.get("/v1/models")
            latencies.append((time.perf_counter() - t0) * 1000)
        result.update(v1_models_listed=listed, v1_models_p50_ms=round(statistics.median(latencies), 1))
        result["memory"] = {
            name: {
                "rss_start_mib": round(rss_start[name], 1),
                f"rss_at_{half}_mib": round(rss_half[name], 1),
                f"rss_at_{uploads}_mib": round(rss_uploaded[name], 1),
                f"rss_at_{args.adapters}_mib": round(rss_end[name], 1),
                # The second half of the uploads: start-up garbage and allocator warm-up are behind
                # it, and the first import (which loads boto3 into the store) after it.
                "kib_per_adapter": round((rss_uploaded[name] - rss_half[name]) * 1024 / (uploads - half), 2),
            }
            for name in services
        }
        result["gateway_index_bytes_per_adapter"] = round(await index_bytes_per_adapter(args.adapters))
        token, pages, listed = "", 0, 0
        t0 = time.perf_counter()
        while True:
            page = await stub.ListAdapters(pb.ListAdaptersRequest(page_size=1000, page_token=token))
            listed, pages, token = listed + len(page.adapters), pages + 1, page.next_page_token
            if not token:
                break
        result.update(
            store_listed=listed, store_list_pages=pages, store_list_all_s=round(time.perf_counter() - t0, 2)
        )
        sample = np.random.default_rng(0).choice(
            len(ids), size=min(args.fetch_sample, len(ids)), replace=False
        )
        fetches = []
        for adapter_id in (ids[i] for i in sample):
            t0 = time.perf_counter()
            await fetch_adapter(stub, ref_by_id(adapter_id))  # raises on a checksum mismatch
            fetches.append((time.perf_counter() - t0) * 1000)
        result.update(fetched_verified=len(fetches), fetch_p50_ms=round(statistics.median(fetches), 1),
                      fetch_p99_ms=round(percentile(fetches, 99), 1))  # fmt: skip
    await http.aclose()
    for service in (gateway, worker, scheduler, store):
        service.terminate()
    result["restart_to_serving_s"] = await restart_s(store_args, work / "scale-restart.log")
    result["disk_gb"] = round(sum(p.stat().st_size for p in (data_dir / "sha256").iterdir()) / 1e9, 2)
    etcd.stop()
    moto.stop()
    return result


async def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lm-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "command": args.command}
    try:
        if args.real_size:
            for round_ in range(args.retain_ablation):
                result[f"bytes_without_retain_{round_}"] = await bytes_phase(args, work, False)
                result[f"bytes_with_retain_{round_}"] = await bytes_phase(args, work, True)
            if not args.retain_ablation:
                result["bytes"] = await bytes_phase(args, work)
        if args.adapters:
            result["scale"] = await scale_phase(args, work)
    finally:
        for stop in reversed(STARTED):
            with contextlib.suppress(Exception):
                stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=10000, help="scale phase: adapters in all (0: skip)")
    parser.add_argument(
        "--s3-imports", type=int, default=1000, help="scale phase: how many are imported from S3"
    )
    parser.add_argument(
        "--real-size", type=int, default=1000, help="bytes phase: real-size adapters (0: skip)"
    )
    parser.add_argument("--ram-budget-mib", type=int, default=256)
    parser.add_argument(
        "--via",
        choices=("store", "gateway", "file"),
        default="store",
        help="bytes phase: uploads to the store or through a gateway, or file:// imports by the store",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="uploads (or imports) at a time")
    parser.add_argument(
        "--retain-ablation",
        type=int,
        default=0,
        help="bytes phase: this many rounds of a store without, then with, --retain-freed-memory",
    )
    parser.add_argument("--list-rounds", type=int, default=10, help="/v1/models calls timed")
    parser.add_argument(
        "--ttft-sample", type=int, default=20, help="S3-imported adapters served cold, then warm"
    )
    parser.add_argument("--fetch-sample", type=int, default=500, help="adapters fetched and verified")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--out", default="", help="also write the JSON result here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    args.command = "python bench/adapter_store_scale.py " + " ".join(sys.argv[1:])
    # The driver stands in for clients on other machines: its own page faults for each upload's
    # buffers would take CPU from the store it measures on the same cores.
    retain_freed_memory()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
