"""``hf://org/repo[@revision][/subdir]``: an adapter on the Hugging Face Hub (a model repo).

Files come through ``huggingface_hub.hf_hub_download`` into its cache (``HF_HOME`` /
``HF_HUB_CACHE``), never the whole repo. The environment is read when an import starts:
``HF_ENDPOINT`` (a mirror), ``HF_TOKEN``, and ``HF_HUB_OFFLINE=1``, which serves only what the
cache holds. Every file is first looked up without downloading (``dry_run``), which gives its
size (checked against the limit before any byte moves) and the commit the revision points at;
then every file is downloaded at that one commit, so a branch that moves mid-import cannot mix
two commits' files.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from services.adapter_store.importers.source import (
    IMPORTED_FILES,
    REQUIRED_FILES,
    AdapterImportSource,
    SourceFile,
    changed_during_import,
    read_capped,
)
from services.adapter_store.importers.source_scope import split_hf
from services.runtime.errors import (
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)

DEFAULT_REVISION = "main"
_HUB_ERRORS = (HfHubHTTPError, HFValidationError, OSError)
"""What huggingface_hub raises for a source it cannot serve (its not-found errors included)."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE``, else ``HF_HOME``/hub, as set now (the library reads them at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


class HubSource(AdapterImportSource):
    def __init__(self, uri: str):
        org, repo, revision, subdir = split_hf(uri)
        if not repo:
            raise InvalidArgument(f"source {uri!r} names no repository: expected hf://org/repo")
        self.uri = uri
        self.repo_id = f"{org}/{repo}"
        self.revision = revision or DEFAULT_REVISION
        self.subfolder = "/".join(subdir) or None
        self._commit = ""

    def _download(self, name: str, revision: str, dry_run: bool):
        return hf_hub_download(
            self.repo_id,
            name,
            subfolder=self.subfolder,
            revision=revision,
            cache_dir=_cache_dir(),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            local_files_only=_offline(),
            dry_run=dry_run,
        )

    def _location(self, name: str) -> str:
        path = f"{self.subfolder}/{name}" if self.subfolder else name
        return f"hf://{self.repo_id}@{self._commit or self.revision}/{path}"

    def list_files(self) -> list[SourceFile]:
        files = []
        for name in IMPORTED_FILES:
            try:
                info = self._download(name, self.revision, dry_run=True)
            except LocalEntryNotFoundError as error:
                if name in REQUIRED_FILES:
                    raise self._error(error, name) from None
                continue  # offline, an optional file the cache lacks is as good as absent
            except RemoteEntryNotFoundError:
                if name in REQUIRED_FILES:
                    raise InvalidArgument(
                        f"{self.uri} is not a PEFT adapter: the repository has no {self._location(name)}"
                    ) from None
                continue
            except _HUB_ERRORS as error:
                raise self._error(error, name) from None
            if self._commit and info.commit_hash != self._commit:
                raise FailedPrecondition(
                    f"{self.uri} moved from commit {self._commit} to {info.commit_hash} during the "
                    f"import (at {name}): import it again"
                )
            self._commit = info.commit_hash
            size = info.file_size if info.file_size is not None else os.path.getsize(info.local_path)
            files.append(SourceFile(name, self._location(name), size, info.commit_hash))
        return files

    def read(self, file: SourceFile, max_bytes: int) -> memoryview:
        try:
            path = self._download(file.name, file.version, dry_run=False)
        except _HUB_ERRORS as error:
            raise self._error(error, file.name) from None
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size != file.size:
                raise changed_during_import(file, f"listed with {file.size} bytes, downloaded {size}")
            return read_capped(stream, file, max_bytes)

    def _error(self, error: Exception, name: str) -> DomainError:
        # GatedRepoError and RevisionNotFoundError subclass RepositoryNotFoundError: test them first.
        if isinstance(error, GatedRepoError):
            return PermissionDenied(
                f"Hub repository {self.repo_id!r} is gated: the store's HF_TOKEN may not read it"
            )
        if isinstance(error, RevisionNotFoundError):
            return NotFound(f"revision {self.revision!r} not found in Hub repository {self.repo_id!r}")
        if isinstance(error, RepositoryNotFoundError):
            return NotFound(f"Hub repository {self.repo_id!r} not found (or private to another account)")
        if isinstance(error, LocalEntryNotFoundError):
            return NotFound(
                f"{self._location(name)} is not in the Hub cache and the Hub is not reachable "
                "(HF_HUB_OFFLINE is set, or the network is down)"
            )
        if isinstance(error, HFValidationError):
            return InvalidArgument(f"source {self.uri!r}: {error}")
        return Unavailable(f"the Hub failed for {self._location(name)}: {error}")
