"""The adapter store's nemesis: concurrent uploads and fetches against store replicas while one
of them is killed (SIGKILL) at a random moment, and the checker of what clients were promised.

The promise (issue 48): every upload that was acknowledged is listed and fetched byte-identical
(sha256), and no fetch fails once the client has retried another replica. The kill comes after a
seed-chosen number of acknowledged uploads, not after a time: the run is the same on any machine.

The client here is the one a gateway or worker is: it calls one replica and, on UNAVAILABLE,
retries on another. An upload whose reply was lost with its replica may have been committed:
its retry's ALREADY_EXISTS, for the same weights, is the acknowledgement it missed.

``tests/adapter_store/test_store_nemesis.py`` runs a bounded slice of it;
``python -m bench.cluster.store_nemesis`` the issue's 200 uploads and 1,000 fetches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc import aio

from bench.cluster.checker import final_store_findings
from bench.cluster.observations import StoreObservation
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ChecksumMismatch, fetch_adapter, ref_by_name, upload_adapter
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2
from services.runtime.process.process import ServiceProcess

OWNER = "nemesis"
WEIGHTS = "adapter_model.safetensors"
CALL_TIMEOUT_S = 60.0
"""Bound on one call (a hang guard: a healthy call takes milliseconds)."""


@dataclass(frozen=True)
class NemesisPlan:
    """One run."""

    uploads: int = 200
    """Adapters uploaded, each under its own name with its own weights."""
    fetches: int = 1000
    """Fetches of adapters already acknowledged, interleaved with the uploads."""
    concurrency: int = 16
    """Calls in flight at once."""
    seed: int = 0
    """Chooses the moment of the kill, the replica killed and the order of the fetches."""


@dataclass
class NemesisReport:
    """What happened, and what the checker found."""

    killed: str = ""
    """Address of the replica killed."""
    killed_after_acks: int = 0
    acknowledged: int = 0
    uploads_refused: list[str] = field(default_factory=list)
    """Uploads that failed even after a retry on another replica (must stay empty)."""
    upload_retries: int = 0
    fetch_retries: int = 0
    fetch_failures: list[str] = field(default_factory=list)
    """Fetches that failed after a retry, or returned other bytes (must stay empty)."""
    missing_from_listing: list[str] = field(default_factory=list)
    """Acknowledged uploads the surviving replica does not list (must stay empty)."""
    wrong_bytes: list[str] = field(default_factory=list)
    """Acknowledged uploads fetched with other bytes at the end (must stay empty)."""
    not_fetchable: list[str] = field(default_factory=list)
    """Acknowledged uploads listed whose fetch failed at the end (must stay empty)."""

    @property
    def holds(self) -> bool:
        return not (
            self.uploads_refused
            or self.fetch_failures
            or self.missing_from_listing
            or self.wrong_bytes
            or self.not_fetchable
        )


def make_adapters(spec, directory: Path, count: int) -> list[dict[str, bytes]]:
    """``count`` small adapters with distinct weights (rank 1 on q_proj: ~75 KB each)."""
    return [
        adapter_files(
            write_peft_adapter(
                directory / f"a{i}", spec, SampleAdapterSpec(rank=1, target_modules=("q_proj",), seed=i)
            )
        )
        for i in range(count)
    ]


class ReplicaClient:
    """Calls go to one replica and move to the next on UNAVAILABLE (each replica tried once)."""

    def __init__(self, addresses: Sequence[str]):
        self._channels = [aio.insecure_channel(address) for address in addresses]
        self._stubs = [adapter_store_pb2_grpc.AdapterStoreStub(channel) for channel in self._channels]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def _each_replica(self, call, start: int):
        """``call(stub)`` on the replicas from ``start`` on; (result, retries)."""
        for attempt in range(len(self._stubs)):
            stub = self._stubs[(start + attempt) % len(self._stubs)]
            try:
                return await call(stub), attempt
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == len(self._stubs) - 1:
                    raise
        raise AssertionError("unreachable")

    async def upload(
        self, files: dict[str, bytes], name: str, start: int
    ) -> tuple[types_pb2.AdapterInfo, int]:
        sha256 = hashlib.sha256(files[WEIGHTS]).hexdigest()
        tries = 0

        async def register(stub):
            nonlocal tries
            tries += 1
            try:
                return await upload_adapter(stub, files, name, OWNER, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.ALREADY_EXISTS or tries == 1:
                    raise
                # A retry: the first try may have committed before its replica died.
                found = await stub.GetAdapter(
                    pb.GetAdapterRequest(ref=ref_by_name(OWNER, name)), timeout=CALL_TIMEOUT_S
                )
                if found.sha256 != sha256:
                    raise
                return found

        return await self._each_replica(register, start)

    async def fetch(self, name: str, start: int) -> tuple[bytes, int]:
        async def fetch(stub):
            return (await fetch_adapter(stub, ref_by_name(OWNER, name), timeout=CALL_TIMEOUT_S))[1]

        return await self._each_replica(fetch, start)


async def run_nemesis(
    replicas: Sequence[ServiceProcess], adapters: Sequence[dict[str, bytes]], plan: NemesisPlan
) -> NemesisReport:
    """Upload ``adapters`` (``plan.uploads`` of them) and fetch them back through ``replicas``,
    killing one replica after a seed-chosen number of acknowledgements; then check."""
    rng = random.Random(plan.seed)
    report = NemesisReport(killed_after_acks=rng.randrange(plan.uploads // 4, 3 * plan.uploads // 4 + 1))
    victim = rng.randrange(len(replicas))
    client = ReplicaClient([r.address for r in replicas])
    acknowledged: dict[str, bytes] = {}
    first_ack = asyncio.Event()
    slots = asyncio.Semaphore(plan.concurrency)

    async def upload(i: int) -> None:
        async with slots:
            name = f"n{i}"
            try:
                info, retries = await client.upload(adapters[i], name, start=i)
            except (grpc.aio.AioRpcError, ChecksumMismatch) as error:
                report.uploads_refused.append(f"{name}: {_describe(error)}")
                return
            report.upload_retries += retries
            assert info.sha256 == hashlib.sha256(adapters[i][WEIGHTS]).hexdigest()
            acknowledged[name] = adapters[i][WEIGHTS]
            first_ack.set()
            if len(acknowledged) == report.killed_after_acks and not report.killed:
                report.killed = replicas[victim].address
                replicas[victim].kill()

    async def fetch(j: int) -> None:
        await first_ack.wait()
        async with slots:
            name = rng.choice(sorted(acknowledged))
            try:
                data, retries = await client.fetch(name, start=j)
            except (grpc.aio.AioRpcError, ChecksumMismatch) as error:
                report.fetch_failures.append(f"{name}: {_describe(error)}")
                return
            report.fetch_retries += retries
            if data != acknowledged[name]:
                report.fetch_failures.append(f"{name}: other bytes")

    try:
        await asyncio.gather(
            *(upload(i) for i in range(plan.uploads)), *(fetch(j) for j in range(plan.fetches))
        )
        report.acknowledged = len(acknowledged)
        survivor = next(r for r in replicas if r.address != report.killed)
        await _check(survivor.address, acknowledged, report)
    finally:
        await client.close()
    return report


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


async def _check(address: str, acknowledged: dict[str, bytes], report: NemesisReport) -> None:
    """Every acknowledged upload is listed by ``address`` and fetched from it byte-identical."""
    observation = await observe_store(address, OWNER, acknowledged)
    expected = {name: frozenset({hashlib.sha256(w).hexdigest()}) for name, w in acknowledged.items()}
    found = final_store_findings(expected, observation)
    report.missing_from_listing = found.missing_from_listing
    report.wrong_bytes = found.wrong_bytes
    report.not_fetchable = [f"{name}: {observation.fetch_errors[name]}" for name in found.not_fetchable]


async def observe_store(address: str, owner: str, names: Iterable[str]) -> StoreObservation:
    """What the store at ``address`` lists for ``owner`` (all pages), and the sha256 of the
    weights it returns for each of ``names`` it lists (for the checker)."""
    digests, errors = {}, {}
    async with aio.insecure_channel(address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        listed, token = set(), ""
        while True:
            page = await stub.ListAdapters(
                pb.ListAdaptersRequest(owner=owner, page_size=1000, page_token=token), timeout=CALL_TIMEOUT_S
            )
            listed |= {a.name for a in page.adapters}
            token = page.next_page_token
            if not token:
                break
        for name in sorted(set(names) & listed):
            try:
                _, data = await fetch_adapter(stub, ref_by_name(owner, name), timeout=CALL_TIMEOUT_S)
            except (grpc.aio.AioRpcError, ChecksumMismatch) as error:
                errors[name] = _describe(error)
                continue
            digests[name] = hashlib.sha256(data).hexdigest()
    return StoreObservation(frozenset(listed), digests, errors)


def store_replicas(
    etcd_endpoint: str, work: Path, count: int, blob_store: str = "", env: dict[str, str] | None = None
) -> list[ServiceProcess]:
    """``count`` store processes on one etcd and one blob tier (``blob_store``, default a
    directory under ``work``), each with its own data dir; started, not yet ready."""
    blob_store = blob_store or str(work / "blobs")
    return [
        ServiceProcess(
            "adapter_store",
            ["--etcd-endpoints", etcd_endpoint, "--lease-ttl-s", "2", "--data-dir", str(work / f"store{i}"),
             "--blob-store", blob_store],
            log_path=work / f"store{i}.log",
            env=env,
        ).start()
        for i in range(count)
    ]  # fmt: skip


async def _main(args: argparse.Namespace) -> int:
    from services.model_files.base_model import load_base_model_spec
    from services.runtime.etcd.etcd_server import EtcdServer

    plan = NemesisPlan(
        uploads=args.uploads, fetches=args.fetches, concurrency=args.concurrency, seed=args.seed
    )
    with (
        tempfile.TemporaryDirectory(prefix="store-nemesis-") as root,
        moto_bucket(args.moto) as (blob_store, env),
    ):
        work = Path(root)
        etcd = EtcdServer(work / "etcd").start()
        replicas = store_replicas(etcd.endpoint, work, args.replicas, blob_store or args.blob_store, env)
        try:
            for replica in replicas:
                await replica.wait_ready()
            adapters = make_adapters(load_base_model_spec(), work / "adapters", plan.uploads)
            report = await run_nemesis(replicas, adapters, plan)
        finally:
            for replica in replicas:
                replica.kill()
            etcd.stop()
    print(json.dumps({"plan": asdict(plan), "blob_store": blob_store or args.blob_store or "directory",
                      "holds": report.holds, **asdict(report)}, indent=2))  # fmt: skip
    return 0 if report.holds else 1


@contextlib.contextmanager
def moto_bucket(wanted: bool = True):
    """``(s3 url, AWS environment)`` of a bucket on a local moto S3 server (over HTTP, as a store
    process reaches a real one), or ("", None) when not ``wanted``."""
    if not wanted:
        yield "", None
        return
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}  # fmt: skip
    boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
        aws_access_key_id="bench", aws_secret_access_key="bench",
    ).create_bucket(Bucket="nemesis")  # fmt: skip
    try:
        yield "s3://nemesis/blobs", env
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uploads", type=int, default=NemesisPlan.uploads)
    parser.add_argument("--fetches", type=int, default=NemesisPlan.fetches)
    parser.add_argument("--concurrency", type=int, default=NemesisPlan.concurrency)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=NemesisPlan.seed)
    parser.add_argument(
        "--blob-store", default="", help="the replicas' --blob-store (default: a shared directory)"
    )
    parser.add_argument("--moto", action="store_true", help="blobs in a bucket on a local moto S3 server")
    raise SystemExit(asyncio.run(_main(parser.parse_args())))


if __name__ == "__main__":
    main()
