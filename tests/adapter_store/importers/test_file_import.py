"""file:// imports: only under granted directories, however the path is spelled."""

from __future__ import annotations

import os

import pytest
from conftest import MAX_ADAPTER_BYTES, TENANT, stored, write_dir

from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.importers.file import FileSource
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)


def test_import_from_a_granted_directory(tmp_path, imports, repository, small_adapter):
    write_dir(tmp_path / "allowed" / "a", small_adapter())
    record = (
        imports(f"file://{tmp_path / 'allowed'}")
        .import_adapter(f"file://{tmp_path / 'allowed' / 'a'}", "a", TENANT, PRIVATE)
        .record
    )
    assert (record.name, record.version) == ("a", 1)


def test_traversal_and_links_out_are_refused(tmp_path, imports, repository, small_adapter):
    files = small_adapter()
    write_dir(tmp_path / "outside", files)
    allowed = write_dir(tmp_path / "allowed" / "a", files).parent
    (allowed / "link").symlink_to(tmp_path / "outside")
    write_dir(allowed / "b", {"adapter_config.json": files["adapter_config.json"]})
    (allowed / "b" / "adapter_model.safetensors").symlink_to(
        tmp_path / "outside" / "adapter_model.safetensors"
    )
    granted = imports(f"file://{allowed}")
    for uri in (f"file://{allowed}/../outside", f"file://{allowed}/link", f"file://{tmp_path}/outside"):
        with pytest.raises(PermissionDenied, match="may not import from"):
            granted.import_adapter(uri, "a", TENANT, PRIVATE)
    with pytest.raises(PermissionDenied, match="symbolic link"):
        granted.import_adapter(f"file://{allowed}/b", "b", TENANT, PRIVATE)
    with pytest.raises(NotFound, match="not found"):
        granted.import_adapter(f"file://{allowed}/missing", "c", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_oversized_file_is_refused(tmp_path, imports, repository, small_adapter):
    files = dict(small_adapter())
    files["adapter_model.safetensors"] = b"\0" * (MAX_ADAPTER_BYTES + 1)
    write_dir(tmp_path / "a", files)
    with pytest.raises(ResourceExhausted, match="adapter_model.safetensors"):
        imports(f"file://{tmp_path}").import_adapter(f"file://{tmp_path}/a", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_file_changed_between_listing_and_read_is_refused(
    tmp_path, imports, repository, small_adapter, monkeypatch
):
    directory = write_dir(tmp_path / "a", small_adapter(0))
    list_files = FileSource.list_files

    def list_then_rewrite(self):
        listed = list_files(self)
        weights = directory / "adapter_model.safetensors"
        weights.write_bytes(small_adapter(1)["adapter_model.safetensors"])
        os.utime(weights, ns=(1, 1))  # same size: only the mtime tells
        return listed

    monkeypatch.setattr(FileSource, "list_files", list_then_rewrite)
    with pytest.raises(FailedPrecondition, match="adapter_model.safetensors changed during the import"):
        imports(f"file://{tmp_path}").import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_a_special_file_is_refused_listed_or_swapped_in_later(
    tmp_path, imports, repository, small_adapter, monkeypatch
):
    files = small_adapter()
    fifo = write_dir(tmp_path / "fifo", {"adapter_config.json": files["adapter_config.json"]})
    os.mkfifo(fifo / "adapter_model.safetensors")
    granted = imports(f"file://{tmp_path}")
    with pytest.raises(InvalidArgument, match=r"fifo/adapter_model.safetensors is not a regular file"):
        granted.import_adapter(f"file://{fifo}", "a", TENANT, PRIVATE)

    directory = write_dir(tmp_path / "a", files)
    list_files = FileSource.list_files

    def list_then_swap_for_a_fifo(self):
        listed = list_files(self)
        (directory / "adapter_model.safetensors").unlink()
        os.mkfifo(directory / "adapter_model.safetensors")  # opening it would wait for a writer
        return listed

    monkeypatch.setattr(FileSource, "list_files", list_then_swap_for_a_fifo)
    with pytest.raises(InvalidArgument, match=r"a/adapter_model.safetensors is not a regular file"):
        granted.import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}


def test_a_directory_swapped_for_a_link_after_the_listing_is_refused(
    tmp_path, imports, repository, small_adapter, monkeypatch
):
    """The file opened is checked by its real path: a parent swapped for a link out of the granted
    directory between the listing and the read (O_NOFOLLOW guards only the last name) is caught."""
    files = small_adapter()
    outside = write_dir(tmp_path / "outside", files)
    directory = write_dir(tmp_path / "allowed" / "a", files)
    list_files = FileSource.list_files

    def list_then_swap_the_directory(self):
        listed = list_files(self)
        directory.rename(tmp_path / "allowed" / "moved")
        directory.symlink_to(outside)
        return listed

    monkeypatch.setattr(FileSource, "list_files", list_then_swap_the_directory)
    with pytest.raises(PermissionDenied, match=f"now resolves to {outside}/adapter_config.json"):
        imports(f"file://{tmp_path / 'allowed'}").import_adapter(f"file://{directory}", "a", TENANT, PRIVATE)
    assert stored(repository) == {"rows": 0, "blobs": 0}
