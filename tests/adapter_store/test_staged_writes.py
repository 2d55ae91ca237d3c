"""A registration's weights are staged on disk while its checks run, and only a registration
whose checks pass makes them a blob: a refused one, a failed write and an unchanged re-import leave
nothing behind."""

from __future__ import annotations

import errno
import hashlib

import pytest

from services.adapter_store import registrar as registrar_module
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.runtime.errors import InvalidArgument

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture
def repo(open_repository):
    return open_repository()


def on_disk(repo: AdapterRepository) -> tuple[list[str], list[str]]:
    """Staged files, and blobs by digest."""
    return sorted(p.name for p in repo.blobs.staging_dir.iterdir()), sorted(
        e.digest for e in repo.blobs.listing()
    )


def blobs_of(record) -> list[str]:
    return sorted([record.sha256, hashlib.sha256(record.config_json.encode()).hexdigest()])


def checks_that_wait_for_the_write(monkeypatch, repo, refuse: bool):
    """Validation that first waits for the weights' write, when one was begun before it, and
    records what was on disk then (a repository that writes after validating has begun none:
    nothing to wait for, and ``seen`` says so). No clock: the write ends on its own thread."""
    begun: list = []
    stage = LocalDirectoryBlobs.stage

    def recording_stage(self, weights):
        staged = stage(self, weights)
        begun.append(staged)
        return staged

    seen: dict = {}
    validate = registrar_module.validate_adapter

    def waiting_validate(*args, **kwargs):
        seen["writes_begun_before_checks"] = len(begun)
        if begun:
            begun[0].written.result()
            seen["during_checks"] = on_disk(repo)
        if refuse:
            raise InvalidArgument("refused for the test")
        return validate(*args, **kwargs)

    monkeypatch.setattr(LocalDirectoryBlobs, "stage", recording_stage)
    monkeypatch.setattr(registrar_module, "validate_adapter", waiting_validate)
    return seen


def test_the_weights_are_written_while_the_adapter_is_checked(monkeypatch, repo, sample_files):
    seen = checks_that_wait_for_the_write(monkeypatch, repo, refuse=False)
    record = repo.registrar.register(
        AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    assert seen["writes_begun_before_checks"] == 1
    temps, blobs = seen["during_checks"]
    assert len(temps) == 1 and blobs == [], "a staged file, not yet a blob"
    assert on_disk(repo) == ([], blobs_of(record))
    assert bytes(repo.read_weights(repo.resolve(AdapterKey(id=record.id)))) == sample_files[WEIGHTS]


def test_a_refused_adapter_leaves_no_file(monkeypatch, repo, sample_files):
    seen = checks_that_wait_for_the_write(monkeypatch, repo, refuse=True)
    with pytest.raises(InvalidArgument, match="refused for the test"):
        repo.registrar.register(
            AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
        )
    assert len(seen["during_checks"][0]) == 1, "refused after its weights were written"
    assert on_disk(repo) == ([], [])
    assert repo.catalog.get_by_name("alice", "a") is None


def test_a_failed_write_fails_the_registration_and_leaves_no_file(monkeypatch, repo, sample_files):
    def disk_full(self, path, data):
        path.write_bytes(bytes(data)[:10])  # what a write cut short leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalDirectoryBlobs, "_write_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        repo.registrar.register(
            AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
        )
    assert on_disk(repo) == ([], [])
    assert repo.catalog.get_by_name("alice", "a") is None


def test_an_unchanged_reimport_writes_nothing(monkeypatch, repo, sample_files):
    first = repo.registrar.register_version(
        AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    writes = []
    write_staged = LocalDirectoryBlobs.write_staged
    monkeypatch.setattr(
        LocalDirectoryBlobs, "write_staged", lambda self, data: writes.append(1) or write_staged(self, data)
    )
    again = repo.registrar.register_version(
        AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    assert (again.changed, again.record.id, writes) == (False, first.record.id, [])
    assert on_disk(repo) == ([], blobs_of(first.record))
