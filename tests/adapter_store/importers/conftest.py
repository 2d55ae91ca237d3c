"""Fixtures for imports: small real adapters, a repository, a moto S3 server and a Hub mirror."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from support.hub_mirror import HubMirror

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.adapter_store.adapter_imports import AdapterImports
from services.adapter_store.import_policy import ImportPolicy
from services.adapter_store.repository import AdapterRepository
from services.adapter_store.validation import ValidationLimits

MAX_ADAPTER_BYTES = 2 << 20
"""Well above a rank-4 q/v adapter of SmolLM2-135M (~0.5 MB), so "oversized" is easy to make."""
TENANT = "alice"


@pytest.fixture(scope="session")
def small_adapter(base_spec, tmp_path_factory):
    """``small_adapter(seed)``: the files of a rank-4 q/v adapter (same seed, same bytes)."""
    root = tmp_path_factory.mktemp("small_adapters")

    def files(seed: int = 0) -> dict[str, bytes]:
        directory = root / f"seed{seed}"
        if not directory.exists():
            write_peft_adapter(
                directory,
                base_spec,
                SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj"), seed=seed),
            )
        return adapter_files(directory)

    return files


@pytest.fixture
def repository(open_repository):
    return open_repository(limits=ValidationLimits(max_rank=64, max_adapter_bytes=MAX_ADAPTER_BYTES))


@pytest.fixture
def imports(repository):
    """``imports(*prefixes)``: imports for a store whose policy grants ``TENANT`` ``prefixes``."""

    def make(*prefixes: str) -> AdapterImports:
        return AdapterImports(repository, ImportPolicy({TENANT: prefixes}))

    return make


def stored(repository: AdapterRepository) -> dict[str, int]:
    """Catalog rows and blob files: what "nothing stored" is checked against."""
    return {"rows": repository.catalog.count(), "blobs": len(list(repository.blobs.listing()))}


@pytest.fixture(scope="session")
def moto_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A boto3 S3 client on the moto server, with the AWS environment the store reads set."""
    for name, value in {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")


def put_adapter(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub mirror as ``HF_ENDPOINT`` with an empty ``HF_HOME`` cache."""
    mirror = HubMirror()
    monkeypatch.setenv("HF_ENDPOINT", mirror.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield mirror
    mirror.close()


def write_dir(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory
