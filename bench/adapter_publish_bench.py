"""Adapter versions at a training loop's pace: how fast publishes go, and how soon every worker
serves the new version, on a local mesh of two workers, in one run.

    .venv/bin/python -m bench.adapter_publish_bench [--probes 30] [--publishes 40] [--rate 10]
        [--window-s 12] [--rounds 2] [--streams 4] [--max-tokens 24] [--pool 24] [--keep-versions 4]
        [--dtype float32] [--prefetch-versions-s 60] [--store-nice N] [--via upload|import]
        [--store-fetch auto|stream]

A mesh is started with ``loramesh up --workers 2`` (float32 workers as every side-by-side bench,
or ``--dtype``; the workers' ``--prefetch-versions-s`` as given, 0 to pull a version only when
it is first asked for; the store replicas' ``--cpu-nice`` as ``--store-nice`` gives, else theirs),
with the store keeping versions by count alone (``--keep-versions-s 0``) and collecting
unreferenced blobs every second and at once (``--collect-interval-s 1 --collect-grace-s 0``), so
a pruned version's row and blob are gone by the time its content comes round again in the pool
and every publish of new content is validated and writes its blob. The published adapter is rank 16 on
all seven projections in float16: 9.8 MB of weights for SmolLM2-135M. Publishes go through the
SDK, ``client.adapters.publish`` on the gateway (an upload), as a training loop's would; with
``--via import``, ``client.adapters.import_uri`` of the directory the loop wrote (the store
reads it, under the mesh's ``--adapter-load-dirs``), as a loop on the same machine would.

Measured:

1. **Publishes per second sustained**, back to back: of new content each time (a pool of
   ``--pool`` contents cycled, more than ``--keep-versions``: full validation and a blob write),
   and alternating between 3 contents the store still keeps (rollbacks: nothing validated or
   written).
2. **Publish → first token served by the new version on every worker** (``--probes`` publishes
   of new content, one at a time), and its parts:

   - *store*: the publish's round trip, until the store acknowledges the committed version;
   - *watch*: from the publish's start until the new row reaches a watch of the catalog's rows
     in etcd (what every gateway and every worker follows: a worker starts pulling a new version
     of a name it serves from there, ``--prefetch-versions-s``). Nearly all of it is the upload
     and the registration up to its commit: the row reaches a watcher within a millisecond of
     the commit, and a worker starts its pull within another (timed inside the processes);
   - *row → acknowledgment*: from the row reaching the watch until the publish is acknowledged
     (the store's reply waits for its own copy of the catalog to show the row, then goes back
     through the gateway): what a worker's pull ahead gains over one started at the
     acknowledgment;
   - *fetch*: ``Worker/LoadAdapter`` of the new id on each worker at once, from the
     acknowledgment until the worker holds its host copy: what is left of a pull its watch
     started, or the whole pull (from the store, parsed) when it started none;
   - *page-in + first token*: ``Worker/Generate`` with that id and one token, pinned to each
     worker by calling it directly: the adapter's pages into the pool (unless the pull's preload
     put them there already), a prefill and a token. The same request without an adapter, made
     before the publish, gives the prefill-and-token part alone.

   The figure is the slowest worker's first token, from the publish's start.
3. **Other adapters' throughput under publishes**: ``--streams`` streams through the gateway on
   two other adapters run for ``--window-s``, quiet and then with publishes at ``--rate`` per
   second (new content, paced; one at a time), alternating for ``--rounds``; reported: tokens
   per second with ÷ without.

Prints one JSON object; load averages before and after are in it (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from grpc import aio

from bench.process_cpu import MACHINE, snapshot, spent_ms
from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.side_by_side import local_mesh
from loramesh.async_client import AsyncClient
from loramesh_cli.mesh_file import MeshFile
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.etcd.adapter_catalog_rows import catalog_rows
from services.runtime.etcd.membership import EtcdConnection, MembershipConfig
from services.runtime.etcd.prefix_follower import ListingPage, follow_prefix

NAME = "policy"
OTHERS = ("other-a", "other-b")
PROMPT = "Summarize the rules of chess in one sentence."
ROLLBACK_CONTENTS = 3


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--probes", type=int, default=30, help="publishes timed to every worker's first token"
    )
    parser.add_argument(
        "--publishes", type=int, default=40, help="back-to-back publishes per sustained-rate run"
    )
    parser.add_argument(
        "--rate", type=float, default=10.0, help="publishes per second during the throughput run"
    )
    parser.add_argument("--window-s", type=float, default=12.0, help="seconds of each throughput window")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/publishing window pairs")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams on the other adapters")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens of each stream")
    parser.add_argument("--pool", type=int, default=24, help="distinct contents cycled as new ones")
    parser.add_argument("--keep-versions", type=int, default=4, help="the store's --keep-versions")
    parser.add_argument("--dtype", default="float32", help="the workers' --dtype (float32 as other benches)")
    parser.add_argument(
        "--prefetch-versions-s", default="60", help="the workers' --prefetch-versions-s (0: no prefetch)"
    )
    parser.add_argument(
        "--store-nice", default=None, help="the store replicas' --cpu-nice (default: the store's own)"
    )
    parser.add_argument(
        "--via",
        choices=("upload", "import"),
        default="upload",
        help="how a version is published: uploaded through the SDK (client.adapters.publish), or "
        "imported by the store from the directory the loop wrote (client.adapters.import_uri with a "
        "file:// URI under --adapter-load-dirs, as a training loop beside the mesh loads into vLLM)",
    )
    parser.add_argument(
        "--store-fetch",
        choices=("auto", "stream"),
        default="auto",
        help="the workers' --store-fetch (auto: read the store's blob file, as they share this machine)",
    )
    return parser.parse_args()


def write_contents(root: Path, count: int, seed0: int, rank: int, targets: tuple[str, ...]) -> list[Path]:
    spec = load_base_model_spec()
    sample = SampleAdapterSpec(rank=rank, lora_alpha=2.0 * rank, target_modules=targets)
    return [
        write_peft_adapter(root / f"s{seed0 + i}", spec, replace(sample, seed=seed0 + i))
        for i in range(count)
    ]


class RowWatch:
    """When each catalog row first reached a watch of the rows' prefix in etcd, as a gateway's."""

    def __init__(self, mesh: MeshFile):
        self._conn = EtcdConnection(MembershipConfig(etcd_endpoints=mesh.etcd_endpoint))
        self._rows = catalog_rows(MembershipConfig().key_prefix)
        self.arrived: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._listed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow())
        await self._listed.wait()

    async def _follow(self) -> None:
        async with contextlib.aclosing(follow_prefix(self._conn, self._rows)) as updates:
            async for update in updates:
                if isinstance(update, ListingPage):
                    if update.last:
                        self._listed.set()
                    continue
                adapter_id = update.kv.key.decode()[len(self._rows) :]
                self.arrived.setdefault(adapter_id, time.perf_counter())

    async def when(self, adapter_id: str, timeout_s: float = 10.0) -> float | None:
        deadline = time.perf_counter() + timeout_s
        while adapter_id not in self.arrived and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        return self.arrived.get(adapter_id)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._conn.close()


class Publisher:
    """One way of publishing a directory as the name's next version: ``--via``."""

    def __init__(self, client: AsyncClient, via: str):
        self._client, self._via = client, via

    async def __call__(self, path: Path, name: str = NAME) -> tuple[str, int, bool]:
        """The version's id and number, and whether this publish changed the name's content."""
        if self._via == "import":
            imported = await self._client.adapters.import_uri(path.resolve().as_uri(), name)
            return imported.adapter.id, imported.adapter.version, imported.changed
        published = await self._client.adapters.publish(path, name)
        return published.id, published.version, published.changed


async def first_token_s(stub, prompt_ids: list[int], adapter_id: str) -> float:
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids, adapter_id=adapter_id, sampling=types_pb2.SamplingParams(max_tokens=1)
    )
    started = time.perf_counter()
    async for reply in stub.Generate(request):
        if reply.token_ids:
            return time.perf_counter() - started
    raise RuntimeError(f"worker gave no token for adapter {adapter_id!r}")


async def on_worker(stub, prompt_ids: list[int], adapter_id: str) -> dict:
    """The host copy (what is left of a prefetch, or the whole pull), then a first token with it."""
    started = time.perf_counter()
    loaded = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id))
    fetch = time.perf_counter() - started
    first = await first_token_s(stub, prompt_ids, adapter_id)
    return {
        "fetch_s": fetch,
        "first_token_s": first,
        "done": time.perf_counter(),
        "resident": loaded.was_resident,
    }


async def probe(publish: Publisher, stubs: list, watch: RowWatch, prompt_ids: list[int], path: Path) -> dict:
    # The same first token without an adapter, before the publish: so it overlaps no pull.
    base = await asyncio.gather(*(first_token_s(stub, prompt_ids, "") for stub in stubs))
    started = time.perf_counter()
    adapter_id, version, changed = await publish(path)
    acknowledged = time.perf_counter()
    assert changed, "a probe publishes new content"
    workers = await asyncio.gather(*(on_worker(stub, prompt_ids, adapter_id) for stub in stubs))
    seen = await watch.when(adapter_id)
    return {
        "version": version,
        "store_s": acknowledged - started,
        "watch_s": (seen - started) if seen is not None else None,
        "row_to_acknowledgment_s": (acknowledged - seen) if seen is not None else None,
        "fetch_s": max(w["fetch_s"] for w in workers),
        "page_in_and_first_token_s": max(w["first_token_s"] for w in workers),
        "base_first_token_s": max(base),
        "publish_to_every_worker_s": max(w["done"] for w in workers) - started,
        "resident_before_asked": sum(w["resident"] for w in workers),
    }


async def sustained(publish: Publisher, paths: list[Path], count: int) -> dict:
    durations = []
    started = time.perf_counter()
    for i in range(count):
        one = time.perf_counter()
        await publish(paths[i % len(paths)])
        durations.append(time.perf_counter() - one)
    elapsed = time.perf_counter() - started
    return {"publishes": count, "per_s": round(count / elapsed, 2), **summary(durations, "publish")}


async def streams_window(client: AsyncClient, streams: int, max_tokens: int, window_s: float) -> float:
    """Tokens per second of ``streams`` looping streams on the other adapters over ``window_s``."""
    stop = time.perf_counter() + window_s
    counted = [0]

    async def loop(i: int) -> None:
        while time.perf_counter() < stop:
            completion = await client.generate(PROMPT, adapter=OTHERS[i % 2], max_tokens=max_tokens)
            counted[0] += len(completion.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(streams)))
    return counted[0] / (time.perf_counter() - started)


async def paced_publishes(
    publish: Publisher, paths: list[Path], rate: float, window_s: float, offset: int
) -> dict:
    interval, started, done = 1.0 / rate, time.perf_counter(), 0
    while time.perf_counter() - started < window_s:
        await publish(paths[(offset + done) % len(paths)])
        done += 1
        wait = started + done * interval - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
    return {"publishes": done, "per_s": round(done / (time.perf_counter() - started), 2)}


def summary(values: list[float], what: str) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        f"{what}_p50_ms": round(1000 * statistics.median(ordered), 1),
        f"{what}_p99_ms": round(1000 * p99, 1),
        f"{what}_max_ms": round(1000 * ordered[-1], 1),
    }


def mesh_pids(mesh: MeshFile) -> dict[str, int]:
    """Every process of the mesh by service name, etcd's included."""
    pids = {name: entry.pid for name, entry in mesh.services.items() if entry.pid}
    pids["etcd"] = mesh.etcd_pid
    return pids


def autogroups(pids: dict[str, int]) -> dict[str, str]:
    """Each process's scheduling group and its niceness (``/autogroup-N nice K``), where the
    kernel has autogroups: what ``--store-nice`` reached."""
    groups = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            groups[name] = Path(f"/proc/{pid}/autogroup").read_text().strip()
    return groups


async def ram_tier_reads(mesh: MeshFile) -> dict[str, list[int]]:
    """Each store replica's RAM tier hits and misses so far: a fetch that misses reads the blob
    back from the blob tier and hashes it."""
    reads = {}
    for name, entry in mesh.services.items():
        if name.startswith("adapter_store"):
            async with aio.insecure_channel(entry.address) as channel:
                stats = await adapter_store_pb2_grpc.AdapterStoreStub(channel).Stats(
                    adapter_store_pb2.StatsRequest()
                )
            reads[name] = [stats.ram_hits, stats.ram_misses]
    return reads


async def cpu_per(phase, pids: dict[str, int], count: int) -> dict:
    """CPU ms per one of ``count`` of ``phase`` (a coroutine) in each process of the mesh and in
    this one (the SDK's and the bench's side), beside the phase's own result."""
    before, mine = snapshot(pids), time.process_time()
    result = await phase
    spent = spent_ms(before, snapshot(pids), count)
    spent["bench_client"] = {"total": round(1000 * (time.process_time() - mine) / count, 1)}
    # What other users of a shared machine took meanwhile (their load moves the figures).
    ours = sum(threads["total"] for name, threads in spent.items() if name != MACHINE)
    spent["outside_mesh"] = {"total": round(spent[MACHINE]["total"] - ours, 1)}
    return {"result": result, "cpu_ms": spent}


def cpu_difference_by_thread(loaded: dict, quiet: dict, per: float = 1.0) -> dict[str, dict[str, float]]:
    """Per process and thread kind, the CPU ms ``loaded`` took beyond ``quiet``, per ``per``: a
    probe beyond the base-model first tokens it also makes (each probe starts with one on every
    worker), or a window with publishes beyond a quiet one, per publish."""
    return {
        name: {
            kind: round((ms - quiet.get(name, {}).get(kind, 0.0)) / per, 1) for kind, ms in threads.items()
        }
        for name, threads in loaded.items()
    }


def cpu_difference(loaded: dict, quiet: dict, per: float) -> dict[str, float]:
    """:func:`cpu_difference_by_thread`'s totals, per process."""
    return {name: threads["total"] for name, threads in cpu_difference_by_thread(loaded, quiet, per).items()}


async def measure(mesh: MeshFile, args, fresh: list[Path], rollback: list[Path], others: list[Path]) -> dict:
    pids = mesh_pids(mesh)
    tokenizer = load_tokenizer().tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    workers = [e.address for name, e in mesh.services.items() if name.startswith("gpu_worker")]
    channels = [aio.insecure_channel(address) for address in workers]
    stubs = [worker_pb2_grpc.WorkerStub(channel) for channel in channels]
    watch = RowWatch(mesh)
    result: dict = {"workers": len(workers), "autogroups": autogroups(pids)}
    async with AsyncClient(mesh.services["gateway"].address, mesh.admin_api_key) as client:
        publish = Publisher(client, args.via)
        try:
            await watch.start()
            for name, path in zip(OTHERS, others, strict=True):
                await client.adapters.upload(path, name)
            for i in range(2):  # warm-up: models, channels, the other adapters on both workers
                await client.generate(PROMPT, adapter=OTHERS[i], max_tokens=2)
                await probe(publish, stubs, watch, prompt_ids, fresh[i])

            async def base_tokens() -> None:
                for _ in range(args.probes):
                    await asyncio.gather(*(first_token_s(stub, prompt_ids, "") for stub in stubs))

            async def probes_run() -> list[dict]:
                return [
                    await probe(publish, stubs, watch, prompt_ids, fresh[(2 + i) % len(fresh)])
                    for i in range(args.probes)
                ]

            # What each probe costs each process in CPU, less the base-model first tokens it
            # makes on every worker too (timed alone, the same count): a publish's own CPU.
            base_cpu = (await cpu_per(base_tokens(), pids, args.probes))["cpu_ms"]
            reads_before = await ram_tier_reads(mesh)
            probed = await cpu_per(probes_run(), pids, args.probes)
            # The probes' fetches each replica served from its RAM tier, and from its blob tier.
            result["store_ram_tier_during_probes"] = {
                name: {"hits": hits - reads_before[name][0], "misses": misses - reads_before[name][1]}
                for name, (hits, misses) in (await ram_tier_reads(mesh)).items()
            }
            probes = probed["result"]
            result["cpu_ms_per_probe"] = probed["cpu_ms"]
            result["cpu_ms_per_base_first_tokens"] = base_cpu
            result["cpu_ms_per_publish_to_every_worker"] = cpu_difference(probed["cpu_ms"], base_cpu, 1)
            result["cpu_ms_per_publish_to_every_worker_by_thread"] = cpu_difference_by_thread(
                probed["cpu_ms"], base_cpu
            )
            result["probes"] = len(probes)
            # Workers that had the version in their pool before the bench asked for it (a pull
            # their watch started, then its preload), out of probes x workers.
            result["resident_before_asked"] = sum(p["resident_before_asked"] for p in probes)
            for part in ("store_s", "watch_s", "row_to_acknowledgment_s", "fetch_s", "page_in_and_first_token_s",
                         "base_first_token_s", "publish_to_every_worker_s"):  # fmt: skip
                result.update(summary([p[part] for p in probes if p[part] is not None], part[:-2]))

            result["sustained_new_content"] = await sustained(publish, fresh, args.publishes)
            for path in rollback:  # the contents rolled back to: kept versions of the name
                await publish(path)
            result["sustained_rollbacks"] = await sustained(publish, rollback, args.publishes)

            quiet, loaded, publishing, extra_cpu, windows_cpu = [], [], [], [], []
            for round_index in range(args.rounds):
                window = streams_window(client, args.streams, args.max_tokens, args.window_s)
                quiet_run = await cpu_per(window, pids, 1)
                quiet.append(quiet_run["result"])

                async def with_publishes(offset: int) -> tuple[float, dict]:
                    streams = asyncio.create_task(
                        streams_window(client, args.streams, args.max_tokens, args.window_s)
                    )
                    paced = await paced_publishes(publish, fresh, args.rate, args.window_s, offset)
                    return await streams, paced

                loaded_run = await cpu_per(with_publishes(round_index * 7), pids, 1)
                tokens_per_s, paced = loaded_run["result"]
                loaded.append(tokens_per_s)
                publishing.append(paced)
                # The CPU the publishes took on top of the streams, per publish, by process (the
                # streams' own work differs between the windows as their throughput does).
                extra_cpu.append(
                    cpu_difference(loaded_run["cpu_ms"], quiet_run["cpu_ms"], paced["publishes"])
                )
                windows_cpu.append({"quiet": quiet_run["cpu_ms"], "publishing": loaded_run["cpu_ms"]})
            result["throughput"] = {
                "quiet_tokens_per_s": [round(v, 1) for v in quiet],
                "publishing_tokens_per_s": [round(v, 1) for v in loaded],
                "publishing": publishing,
                "ratio": round(statistics.median(loaded) / statistics.median(quiet), 3),
                "extra_cpu_ms_per_publish": extra_cpu,
                "cpu_ms_per_window": windows_cpu,
            }
        finally:
            await watch.close()
            for channel in channels:
                await channel.close()
    return result


def main() -> None:
    args = arguments()
    root = Path(tempfile.mkdtemp(prefix="lm-publish-"))
    fresh = write_contents(root / "fresh", args.pool, 1000, 16, LORA_TARGETS)
    rollback = fresh[:ROLLBACK_CONTENTS]
    others = write_contents(root / "others", 2, 0, 8, ("q_proj", "v_proj"))
    size = (fresh[0] / "adapter_model.safetensors").stat().st_size
    load_before = os.getloadavg()
    flags = ["--keep-versions", str(args.keep_versions), "--keep-versions-s", "0"]
    flags += ["--collect-interval-s", "1", "--collect-grace-s", "0"]
    flags += ["--dtype", args.dtype]  # after local_mesh's own --dtype: this one holds
    flags += ["--prefetch-versions-s", args.prefetch_versions_s]
    if args.store_nice is not None:
        flags += ["--cpu-nice", args.store_nice]
    flags += ["--store-fetch", args.store_fetch]
    if args.via == "import":
        flags += ["--adapter-load-dirs", str(root)]
    try:
        with local_mesh(workers=2, flags=flags) as mesh:
            result = asyncio.run(measure(mesh, args, fresh, rollback, others))
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 26 contents: 0.2 GB
    print(
        json.dumps(
            {
                "adapter_bytes": size,
                "rank": 16,
                "keep_versions": args.keep_versions,
                "worker_dtype": args.dtype,
                "prefetch_versions_s": float(args.prefetch_versions_s),
                "store_nice": args.store_nice,
                "via": args.via,
                "store_fetch": args.store_fetch,
                "cpus": os.cpu_count(),
                "load_before": [round(v, 2) for v in load_before],
                "load_after": [round(v, 2) for v in os.getloadavg()],
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
