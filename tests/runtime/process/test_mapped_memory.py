"""Buffers off the heap (huge-page advised from 2 MiB) and whole files read into them, past the
page cache or through it."""

from __future__ import annotations

import os

import pytest

from services.runtime.process.file_system import file_system_identity
from services.runtime.process.mapped_memory import HUGE_PAGE_BYTES, populated_mapping, read_file_mapped


@pytest.mark.parametrize("size", [0, 1, 4096, HUGE_PAGE_BYTES - 1, 5 * HUGE_PAGE_BYTES + 123])
def test_a_mapping_holds_the_size_asked_and_takes_writes(size):
    mapping = populated_mapping(size)
    assert len(mapping) == max(size, 1)
    mapping[-1:] = b"x"
    assert mapping[-1:] == b"x" and mapping[:1] in (b"\0", b"x")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 7, 4096, 3 * HUGE_PAGE_BYTES + 5])
def test_a_file_is_read_whole(tmp_path, size, direct):
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    view = read_file_mapped(path, direct)
    assert bytes(view) == data and len(view) == size


def test_a_missing_file_raises_what_open_does(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_file_mapped(tmp_path / "gone")


def test_the_file_system_identity_names_the_boot_and_the_mount_namespace():
    identity = file_system_identity()
    boot, _, namespace = identity.rpartition(":")
    assert boot and int(namespace) == os.stat("/proc/self/ns/mnt").st_ino
