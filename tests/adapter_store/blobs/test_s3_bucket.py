"""S3Blobs against a real S3 API (moto's server over HTTP): bytes in and out unchanged, a blob
written once, listings and deletes, the errors a misconfigured or unreachable store gets, and a
server that does not implement conditional writes."""

from __future__ import annotations

import http.client
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import boto3
import pytest

from services.adapter_store.blobs.backend import BlobMissing
from services.adapter_store.blobs.s3_bucket import S3Blobs
from services.runtime.errors import FailedPrecondition, Unavailable


def keys(bucket: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listed.get("Contents", ()))


@pytest.mark.parametrize("size", [0, 1, 5 << 20])
def test_put_then_get_gives_the_same_bytes(bucket, blob, size):
    digest, data = blob(1, size)
    blobs = S3Blobs(f"s3://{bucket}/store")
    blobs.put(digest, memoryview(data))
    assert blobs.get(digest) == data
    assert blobs.exists(digest)
    assert keys(bucket) == [f"store/blobs/{digest}"]


def test_without_a_prefix_blobs_sit_at_the_bucket_root(bucket, blob):
    digest, data = blob(1, 10)
    blobs = S3Blobs(f"s3://{bucket}")
    blobs.put(digest, data)
    assert keys(bucket) == [f"blobs/{digest}"]
    assert blobs.description == f"s3://{bucket}"


def test_a_published_stage_is_a_blob_and_a_discarded_one_is_nothing(bucket, blob):
    blobs = S3Blobs(f"s3://{bucket}/store")
    (kept, kept_data), (dropped, dropped_data) = blob(1, 100), blob(2, 100)
    staged = blobs.stage(kept_data)
    blobs.stage(dropped_data).discard()
    assert keys(bucket) == []
    staged.publish(kept)
    assert blobs.get(kept) == kept_data
    assert not blobs.exists(dropped)
    assert blobs.collect_staging(older_than_s=0, now_s=time.time()) == 0


def test_a_blob_is_written_once(bucket, blob):
    """A second put of a digest keeps the first object: the bytes of a digest never change (put
    different bytes under it here only to see which ones stay)."""
    digest, data = blob(1, 100)
    blobs = S3Blobs(f"s3://{bucket}/store")
    blobs.put(digest, data)
    blobs.put(digest, data)
    blobs.put(digest, b"other bytes")
    assert blobs.get(digest) == data


def test_a_missing_blob(bucket, blob):
    digest, _ = blob(1, 10)
    blobs = S3Blobs(f"s3://{bucket}/store")
    with pytest.raises(BlobMissing):
        blobs.get(digest)
    assert not blobs.exists(digest)
    blobs.delete(digest)


def test_listing_and_delete(bucket, blob):
    blobs = S3Blobs(f"s3://{bucket}/store")
    written = dict(blob(seed, seed * 1000) for seed in range(1, 4))
    before = time.time()
    for digest, data in written.items():
        blobs.put(digest, data)
    boto3.client("s3").put_object(Bucket=bucket, Key="elsewhere/blobs/x", Body=b"not ours")
    listed = {entry.digest: entry for entry in blobs.listing()}
    assert {digest: entry.size for digest, entry in listed.items()} == {
        digest: len(data) for digest, data in written.items()
    }
    assert all(before - 2 <= entry.modified_s <= time.time() + 2 for entry in listed.values())
    gone = next(iter(written))
    blobs.delete(gone)
    assert not blobs.exists(gone)
    assert {entry.digest for entry in blobs.listing()} == set(written) - {gone}


def test_listing_goes_past_one_page(bucket, blob):
    blobs = S3Blobs(f"s3://{bucket}")
    written = dict(blob(seed, 1) for seed in range(1001))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(blobs.put, written, written.values()))
    assert sorted(entry.digest for entry in blobs.listing()) == sorted(written)


def test_puts_from_eight_threads(bucket, blob):
    """Distinct blobs, and one blob put by every thread at once."""
    blobs = S3Blobs(f"s3://{bucket}/store")
    written = dict(blob(seed, 64 << 10) for seed in range(32))
    shared, shared_data = blob(99, 64 << 10)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(blobs.put, written, written.values()))
        list(pool.map(lambda _: blobs.put(shared, shared_data), range(8)))
    assert {entry.digest for entry in blobs.listing()} == set(written) | {shared}
    assert all(blobs.get(digest) == data for digest, data in written.items())
    assert blobs.get(shared) == shared_data


def test_a_missing_bucket_is_named_at_start(aws_environment):
    with pytest.raises(FailedPrecondition, match="bucket 'no-such-bucket' does not exist"):
        S3Blobs("s3://no-such-bucket/store")


def test_an_unreachable_s3_is_unavailable_and_names_the_bucket(aws_environment, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(Unavailable, match="some-bucket"):
        S3Blobs("s3://some-bucket/store")


class _RefusingConditionalPuts(BaseHTTPRequestHandler):
    """Forwards to the moto server, but answers the first ``refusals_left`` puts with
    ``If-None-Match`` with ``refusal``: what a server that does not implement conditional writes
    (501 NotImplemented) or S3 amid racing puts of one key (409) answers."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    refusal = (501, "NotImplemented")
    refusals_left = 0
    refused = 0

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        cls = type(self)
        if self.command == "PUT" and "If-None-Match" in self.headers and cls.refusals_left:
            cls.refusals_left -= 1
            cls.refused += 1
            status, code = cls.refusal
            self._reply(status, {}, f"<Error><Code>{code}</Code><Message>no</Message></Error>".encode())
            return
        upstream = http.client.HTTPConnection(urlsplit(cls.upstream).netloc)
        upstream.request(self.command, self.path, body, dict(self.headers))
        reply = upstream.getresponse()
        data = reply.read()
        upstream.close()
        skipped = {"content-length", "transfer-encoding", "connection"}
        self._reply(reply.status, {k: v for k, v in reply.getheaders() if k.lower() not in skipped}, data)

    def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_s3(aws_environment, monkeypatch):
    """``refusing_s3(status, code, times)``: the store's S3 is the moto server behind
    :class:`_RefusingConditionalPuts`; returns the handler class (its ``refused`` count)."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _RefusingConditionalPuts)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()

    def refuse(status: int, code: str, times: int) -> type[_RefusingConditionalPuts]:
        handler = _RefusingConditionalPuts
        handler.upstream = aws_environment
        handler.refusal = (status, code)
        handler.refusals_left = times
        handler.refused = 0
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
        return handler

    yield refuse
    proxy.shutdown()
    proxy.server_close()


def test_a_server_without_conditional_puts_gets_plain_ones(bucket, blob, refusing_s3):
    server = refusing_s3(501, "NotImplemented", times=100)
    blobs = S3Blobs(f"s3://{bucket}/store")
    written = dict(blob(seed, 100) for seed in range(3))
    for digest, data in written.items():
        blobs.put(digest, data)
    assert all(blobs.get(digest) == data for digest, data in written.items())
    assert server.refused == 1  # then it asks no more


def test_a_put_racing_another_is_tried_again(bucket, blob, refusing_s3):
    server = refusing_s3(409, "ConditionalRequestConflict", times=2)
    blobs = S3Blobs(f"s3://{bucket}/store")
    digest, data = blob(1, 100)
    blobs.put(digest, data)
    assert server.refused == 2
    assert blobs.get(digest) == data
    blobs.put(digest, b"other bytes")  # still conditional: written once
    assert blobs.get(digest) == data
