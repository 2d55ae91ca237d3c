"""s3:// imports against a real S3 API: moto's standalone server, in memory."""

from __future__ import annotations

import hashlib

import pytest
from conftest import MAX_ADAPTER_BYTES, TENANT, put_adapter, stored

from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.importers.s3 import S3Source
from services.runtime.errors import FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted


def test_import_registers_the_adapter_with_its_sha256(s3, imports, repository, small_adapter):
    files = small_adapter()
    put_adapter(s3, "team", "adapters/a", files)
    registration = imports("s3://team/adapters").import_adapter("s3://team/adapters/a", "a", TENANT, PRIVATE)
    assert registration.changed
    record = registration.record
    assert (record.owner, record.name, record.version, record.rank) == (TENANT, "a", 1, 4)
    assert record.sha256 == hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()
    assert bytes(repository.read_weights(record)) == files["adapter_model.safetensors"]


def test_tenant_refused_a_bucket_it_is_not_given(s3, imports, repository, small_adapter):
    put_adapter(s3, "other-team", "a", small_adapter())
    with pytest.raises(PermissionDenied, match="s3://other-team/a"):
        imports("s3://team").import_adapter("s3://other-team/a", "a", TENANT, PRIVATE)
    with pytest.raises(PermissionDenied):  # a prefix covers whole segments only
        imports("s3://other-team/a").import_adapter("s3://other-team/ab", "a", TENANT, PRIVATE)
    with pytest.raises(PermissionDenied):  # another tenant's grant is not this tenant's
        imports("s3://other-team").import_adapter("s3://other-team/a", "a", "bob", PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_missing_bucket_and_key_are_not_found_naming_them(s3, imports, repository, small_adapter):
    allowed = imports("s3://no-such-bucket", "s3://half")
    with pytest.raises(NotFound, match="bucket 'no-such-bucket'"):
        allowed.import_adapter("s3://no-such-bucket/a", "a", TENANT, PRIVATE)
    files = small_adapter()
    put_adapter(s3, "half", "a", {"adapter_config.json": files["adapter_config.json"]})
    with pytest.raises(NotFound, match="key 'a/adapter_model.safetensors' not found in bucket 'half'"):
        allowed.import_adapter("s3://half/a", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_oversized_file_is_refused_before_it_is_read(s3, imports, repository, small_adapter, monkeypatch):
    files = dict(small_adapter())
    files["adapter_model.safetensors"] = b"\0" * (MAX_ADAPTER_BYTES + 1)
    put_adapter(s3, "big", "a", files)
    reads = []
    monkeypatch.setattr(S3Source, "read", lambda self, file, limit: reads.append(file))
    with pytest.raises(ResourceExhausted, match="s3://big/a/adapter_model.safetensors"):
        imports("s3://big").import_adapter("s3://big/a", "a", TENANT, PRIVATE)
    assert reads == [] and stored(repository) == {"rows": 0, "blobs": 0}


def test_object_overwritten_between_listing_and_read_is_refused(
    s3, imports, repository, small_adapter, monkeypatch
):
    put_adapter(s3, "moving", "a", small_adapter(0))
    list_files = S3Source.list_files

    def list_then_overwrite(self):
        listed = list_files(self)
        s3.put_object(Bucket="moving", Key="a/adapter_model.safetensors",
                      Body=small_adapter(1)["adapter_model.safetensors"])  # fmt: skip
        return listed

    monkeypatch.setattr(S3Source, "list_files", list_then_overwrite)
    with pytest.raises(FailedPrecondition, match="s3://moving/a/adapter_model.safetensors changed"):
        imports("s3://moving").import_adapter("s3://moving/a", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_credentials_are_read_when_the_import_runs(s3, imports, repository, small_adapter, monkeypatch):
    put_adapter(s3, "late", "a", small_adapter())
    source = imports("s3://late")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(Exception, match="unreachable"):
        source.import_adapter("s3://late/a", "a", TENANT, PRIVATE)
