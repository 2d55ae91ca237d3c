"""Fixtures for blob backends: a real S3 API (a moto server over HTTP) and a fresh bucket per
test, reached through the AWS environment the store reads."""

from __future__ import annotations

import hashlib
import uuid

import boto3
import pytest
from moto.server import ThreadedMotoServer


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free port, one for the session (each test makes its own bucket)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield "http://{}:{}".format(*server.get_host_and_port())
    server.stop()


@pytest.fixture
def aws_environment(s3_endpoint, monkeypatch) -> str:
    """The moto server as the store's S3 (its endpoint returned): what ``s3_client()`` reads."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture
def bucket(aws_environment) -> str:
    """A new, empty bucket's name."""
    name = f"blobs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=aws_environment, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _blob(seed: int, size: int) -> tuple[str, bytes]:
    data = hashlib.shake_256(seed.to_bytes(8, "little")).digest(size) if size else b""
    return hashlib.sha256(data).hexdigest(), data


@pytest.fixture
def blob():
    """``blob(seed, size)``: ``size`` bytes that differ by ``seed``, and their digest."""
    return _blob
