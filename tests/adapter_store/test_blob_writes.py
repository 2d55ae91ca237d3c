"""A registration's weights reach disk while its checks run, and only a registration whose
checks pass makes them a blob: a refused one, a failed write and an unchanged re-import leave
nothing behind."""

from __future__ import annotations

import errno

import pytest

from services.adapter_store import registrar as registrar_module
from services.adapter_store.blob_store import BlobStore
from services.adapter_store.blob_writes import BlobWrites, PendingBlob
from services.adapter_store.catalog import PRIVATE
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.adapter_store.validation import ValidationLimits
from services.runtime.errors import InvalidArgument

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture
def repo(tmp_path, base_spec):
    opened = AdapterRepository(tmp_path / "store", base_spec, ValidationLimits(), 64 << 20)
    opened.open()
    yield opened
    opened.close()


def on_disk(repo: AdapterRepository) -> tuple[list[str], list[str]]:
    return sorted(p.name for p in repo.blobs.tmp_dir.iterdir()), sorted(repo.blobs.ids())


def checks_that_wait_for_the_write(monkeypatch, repo, refuse: bool):
    """Validation that first waits for the weights' write, when one was begun before it, and
    records what was on disk then (a repository that writes after validating has begun none:
    nothing to wait for, and ``seen`` says so). No clock: the write ends on its own thread."""
    begun: list[PendingBlob] = []
    start = BlobWrites.start

    def recording_start(self, weights):
        pending = start(self, weights)
        begun.append(pending)
        return pending

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

    monkeypatch.setattr(BlobWrites, "start", recording_start)
    monkeypatch.setattr(registrar_module, "validate_adapter", waiting_validate)
    return seen


def test_the_weights_are_written_while_the_adapter_is_checked(monkeypatch, repo, sample_files):
    seen = checks_that_wait_for_the_write(monkeypatch, repo, refuse=False)
    record = repo.registrar.register(
        AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    assert seen["writes_begun_before_checks"] == 1
    temps, blobs = seen["during_checks"]
    assert len(temps) == 1 and blobs == [], "a temp file, not yet a blob"
    assert on_disk(repo) == ([], [record.id])
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

    monkeypatch.setattr(BlobStore, "_write_file", disk_full)
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
    write_temp = BlobStore.write_temp
    monkeypatch.setattr(
        BlobStore, "write_temp", lambda self, data: writes.append(1) or write_temp(self, data)
    )
    again = repo.registrar.register_version(
        AdapterUpload("a", "alice", PRIVATE, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    assert (again.changed, again.record.id, writes) == (False, first.record.id, [])
    assert on_disk(repo) == ([], [first.record.id])
