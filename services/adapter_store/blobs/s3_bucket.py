"""Blobs as objects in an S3 (or S3-compatible) bucket: store replicas on several hosts share
them without a shared file system.

Blob ``<digest>`` is the object ``<prefix>/blobs/<digest>``. A put is atomic on S3's side (an
object is visible whole or not at all), so a write needs no staging area: :meth:`S3Blobs.stage`
only keeps the bytes, the put happens at publish, and a crash leaves nothing to collect. A put is
conditional (``If-None-Match: *``) so a blob is written once: a blob already there holds the
same bytes, and S3's "precondition failed" means just that. A server that does not implement
conditional writes gets plain puts (the same bytes again, harmless).

The client is the one the importers use (:func:`~services.adapter_store.importers.s3.s3_client`:
the standard AWS environment), so the store needs no S3 settings of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from services.adapter_store.blobs.backend import BlobEntry, BlobMissing
from services.adapter_store.importers.s3 import _CHANGED, _DENIED, _MISSING_BUCKET, _MISSING_KEY, s3_client
from services.runtime.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from services.runtime.process.mapped_memory import populated_mapping

log = logging.getLogger("loramesh.adapter_store")

_UNSUPPORTED = {"NotImplemented", "501"}
"""What a server without conditional writes answers a put with ``If-None-Match``."""
_CONFLICT = {"ConditionalRequestConflict", "409"}
"""S3's answer to a conditional put racing another put of the same key: try again."""
_CONFLICT_TRIES = 5


def _code(error: ClientError) -> str:
    """The error's S3 code (a status number for a reply without a body: HEAD's)."""
    return str(error.response.get("Error", {}).get("Code", ""))


class _StagedPut:
    """Bytes kept until :meth:`publish` puts them: S3 has no half-written objects to stage."""

    def __init__(self, blobs: S3Blobs, data):
        self._blobs = blobs
        self._data = data

    def publish(self, digest: str) -> None:
        if self._data is None:
            raise RuntimeError(f"blob {digest} was discarded before it was published")
        self._blobs.put(digest, self._data)
        self._data = None

    def discard(self) -> None:
        self._data = None


class S3Blobs:
    """One object per blob under ``s3://bucket/prefix/blobs/``, named by its sha256."""

    def __init__(self, url: str, client=None):
        """``url``: ``s3://bucket`` or ``s3://bucket/prefix``; the bucket must exist (checked
        here, so a misconfigured store fails at start, not at its first upload)."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise InvalidArgument(f"blob store {url!r} names no bucket: expected s3://bucket/prefix")
        self.description = url
        self.bucket = bucket
        prefix = prefix.strip("/")
        self._blob_prefix = f"{prefix}/blobs/" if prefix else "blobs/"
        self._client = client or s3_client()
        self._conditional = True
        """Whether puts carry ``If-None-Match``; cleared when the server does not implement it."""
        self._check_bucket()

    def _check_bucket(self) -> None:
        missing = FailedPrecondition(
            f"bucket {self.bucket!r} does not exist ({self.description}): create it before starting the store"
        )
        with self._domain_errors("", missing, _MISSING_BUCKET | _MISSING_KEY):
            self._client.head_bucket(Bucket=self.bucket)

    def _key(self, digest: str) -> str:
        return self._blob_prefix + digest

    @contextmanager
    def _domain_errors(
        self, key: str, missing: Exception | None = None, missing_codes: set[str] = _MISSING_KEY
    ) -> Iterator[None]:
        """S3's errors as the project's, naming the bucket and key: ``missing`` for what is not
        there, denied, or unavailable (unreachable, 5xx, any other refusal a retry may cure)."""
        location = f"s3://{self.bucket}/{key}"
        try:
            yield
        except ClientError as error:
            code = _code(error)
            if missing is not None and code in missing_codes:
                raise missing from None
            if code in _DENIED:
                raise PermissionDenied(
                    f"the store's S3 credentials may not use {location} ({code})"
                ) from None
            raise Unavailable(f"S3 refused {location}: {error}") from None
        except BotoCoreError as error:
            raise Unavailable(f"S3 is unreachable for {location}: {error}") from None

    def stage(self, data) -> _StagedPut:
        return _StagedPut(self, data)

    def put(self, digest: str, data) -> None:
        key = self._key(digest)
        body = bytes(data)  # botocore takes bytes or a file, not a memoryview (bytes are not copied)
        with self._domain_errors(key):
            for _ in range(_CONFLICT_TRIES):
                if self._put_once(key, body):
                    return
            raise Unavailable(f"S3 kept refusing s3://{self.bucket}/{key}: other puts of it conflicted")

    def _put_once(self, key: str, body: bytes) -> bool:
        """Whether the blob is there now; False when the put is to be tried again."""
        conditional = {"IfNoneMatch": "*"} if self._conditional else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body, **conditional)
        except ClientError as error:
            code = _code(error)
            if code in _CHANGED:
                return True  # already there, with the same bytes
            if conditional and code in _UNSUPPORTED:
                log.warning(
                    "%s does not implement conditional puts: blobs are put unconditionally", self.description
                )
                self._conditional = False
                return False
            if code in _CONFLICT:
                return False
            raise
        return True

    def flush(self) -> None:
        """Nothing to do: a put is durable when S3 answers it."""

    def get(self, digest: str) -> memoryview:
        """The blob's bytes in an anonymous mapping (off the Python heap, like a local blob's)."""
        key = self._key(digest)
        with self._domain_errors(key, BlobMissing(digest)):
            reply = self._client.get_object(Bucket=self.bucket, Key=key)
            size = reply["ContentLength"]
            mapping = memoryview(populated_mapping(size))
            with reply["Body"] as body:
                filled = 0
                while filled < size:
                    read = body.readinto(mapping[filled:size])
                    if not read:
                        raise Unavailable(f"S3 sent {filled} of the {size} bytes of s3://{self.bucket}/{key}")
                    filled += read
        return mapping[:size]

    def file_path(self, digest: str) -> Path | None:
        return None  # objects, not files

    def exists(self, digest: str) -> bool:
        try:
            with self._domain_errors(self._key(digest), BlobMissing(digest)):
                self._client.head_object(Bucket=self.bucket, Key=self._key(digest))
        except BlobMissing:
            return False
        return True

    def delete(self, digest: str) -> None:
        key = self._key(digest)
        with self._domain_errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    def listing(self) -> Iterator[BlobEntry]:
        with self._domain_errors(self._blob_prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._blob_prefix
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    digest = item["Key"][len(self._blob_prefix) :]
                    yield BlobEntry(digest, item["Size"], item["LastModified"].timestamp())

    def collect_staging(self, older_than_s: float, now_s: float) -> int:
        """Nothing to collect: a put is atomic, so a crash leaves no half-visible blob."""
        return 0

    def close(self) -> None:
        """Nothing to finish (a put is done when it returns) or release: the client is shared
        with the importers."""
