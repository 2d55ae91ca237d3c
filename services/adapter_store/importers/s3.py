"""``s3://bucket/prefix``: an adapter directory in an S3 (or S3-compatible) bucket.

Configured by the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, or any other source of boto3's credential chain),
read when an import starts, not when the store starts, so credentials rotated in the environment
apply at once. One client serves every import under the same environment: making one loads
botocore's service model (~0.2 s, longer than importing a small adapter from it).
A read asks for the listed ETag (``If-Match``): an object overwritten since the listing is
refused instead of read.
"""

from __future__ import annotations

import functools
import os

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from services.adapter_store.importers.source import (
    IMPORTED_FILES,
    REQUIRED_FILES,
    AdapterImportSource,
    SourceFile,
    changed_during_import,
    read_capped,
)
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable

_MISSING_BUCKET = {"NoSuchBucket"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_CHANGED = {"PreconditionFailed", "412"}


#: The environment variables a client depends on: a change in any of them makes a new one.
_AWS_ENVIRONMENT = (
    "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)  # fmt: skip


def s3_client():
    """A client for the AWS environment as it is now (thread-safe, shared by the imports)."""
    return _client_for(tuple(os.environ.get(name) for name in _AWS_ENVIRONMENT))


@functools.lru_cache(maxsize=4)
def _client_for(environment: tuple[str | None, ...]):
    values = dict(zip(_AWS_ENVIRONMENT, environment, strict=True))
    session = boto3.session.Session(region_name=values["AWS_REGION"] or values["AWS_DEFAULT_REGION"] or None)
    return session.client("s3", endpoint_url=values["AWS_ENDPOINT_URL"] or None)


class S3Source(AdapterImportSource):
    def __init__(self, uri: str, client=None):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise InvalidArgument(f"source {uri!r} names no bucket: expected s3://bucket/prefix")
        self.uri = uri
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client = client or s3_client()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _location(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def list_files(self) -> list[SourceFile]:
        listed: dict[str, dict] = {}
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(""), Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    listed[item["Key"]] = item
        except ClientError as error:
            raise self._error(error, self._key("")) from None
        except BotoCoreError as error:
            raise Unavailable(f"S3 is unreachable for {self.uri}: {error}") from None
        files = []
        for name in IMPORTED_FILES:
            item = listed.get(self._key(name))
            if item is None:
                if name in REQUIRED_FILES:
                    raise NotFound(f"key {self._key(name)!r} not found in bucket {self.bucket!r}")
                continue
            files.append(SourceFile(name, self._location(item["Key"]), item["Size"], item["ETag"]))
        return files

    def read(self, file: SourceFile, max_bytes: int) -> memoryview:
        key = self._key(file.name)
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=key, IfMatch=file.version)
        except ClientError as error:
            raise self._error(error, key, file) from None
        except BotoCoreError as error:
            raise Unavailable(f"S3 is unreachable for {file.location}: {error}") from None
        body = reply["Body"]
        try:
            if reply.get("ETag", file.version) != file.version:
                raise changed_during_import(file, f"ETag {file.version} became {reply['ETag']}")
            return read_capped(body, file, max_bytes)
        finally:
            body.close()

    def _error(self, error: ClientError, key: str, file: SourceFile | None = None):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in _MISSING_BUCKET:
            return NotFound(f"bucket {self.bucket!r} not found ({self.uri})")
        if file is not None and code in _CHANGED | _MISSING_KEY:
            return changed_during_import(file, "its ETag no longer matches the listing")
        if code in _MISSING_KEY:
            return NotFound(f"key {key!r} not found in bucket {self.bucket!r}")
        if code in _DENIED:
            return PermissionDenied(f"the store's S3 credentials may not read {self._location(key)} ({code})")
        return Unavailable(f"S3 refused {self._location(key)}: {code} {error}")
