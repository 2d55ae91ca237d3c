"""``file:///abs/path``: an adapter directory on the store's own machine.

Which directories may be read is the import policy's (:mod:`services.adapter_store.import_policy`),
checked on the resolved path, so ``..`` and a symbolic link out of an allowed directory are
refused. Inside the directory the files are opened without following links (a link named
``adapter_model.safetensors`` pointing at ``/etc/shadow`` is refused, not read), and each is
checked against its listed size and mtime before and after the read. What was opened is checked
too, since the directory can change after the listing: it must be a regular file (a FIFO swapped
in is opened without blocking, then refused) whose real path is still the one listed (a parent
directory swapped for a link is refused).

``POST /v1/load_lora_adapter`` with a plain path is such an import too (the gateway confines the
path under its ``--adapter-load-dirs`` and sends ``file://`` + the resolved directory).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from services.adapter_store.importers.source import (
    IMPORTED_FILES,
    REQUIRED_FILES,
    AdapterImportSource,
    SourceFile,
    changed_during_import,
    read_capped,
)
from services.adapter_store.importers.source_scope import file_path
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied


def _version(status: os.stat_result) -> str:
    return f"size={status.st_size} mtime_ns={status.st_mtime_ns}"


class FileSource(AdapterImportSource):
    def __init__(self, uri: str):
        self.uri = uri
        self.directory: Path = file_path(uri)

    def _location(self, name: str) -> str:
        return f"file://{self.directory / name}"

    def list_files(self) -> list[SourceFile]:
        if not self.directory.is_dir():
            raise NotFound(f"directory {self.directory} not found ({self.uri})")
        files = []
        for name in IMPORTED_FILES:
            try:
                status = os.lstat(self.directory / name)
            except FileNotFoundError:
                if name in REQUIRED_FILES:
                    raise NotFound(f"{self._location(name)} not found") from None
                continue
            if stat.S_ISLNK(status.st_mode):
                raise PermissionDenied(f"{self._location(name)} is a symbolic link: links are not followed")
            if not stat.S_ISREG(status.st_mode):
                raise InvalidArgument(f"{self._location(name)} is not a regular file")
            files.append(SourceFile(name, self._location(name), status.st_size, _version(status)))
        return files

    def read(self, file: SourceFile, max_bytes: int) -> memoryview:
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; a regular file ignores it.
            fd = os.open(self.directory / file.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise changed_during_import(file, "it was removed") from None
        except OSError as error:  # ELOOP: replaced by a link since the listing
            raise PermissionDenied(
                f"{file.location} cannot be opened without following a link: {error}"
            ) from None
        with os.fdopen(fd, "rb") as stream:
            self._check_opened(file, fd)
            if _version(os.fstat(fd)) != file.version:
                raise changed_during_import(file, f"listed {file.version}, opened {_version(os.fstat(fd))}")
            data = read_capped(stream, file, max_bytes)
            if _version(os.fstat(fd)) != file.version:
                raise changed_during_import(file, f"listed {file.version}, now {_version(os.fstat(fd))}")
        return data

    def _check_opened(self, file: SourceFile, fd: int) -> None:
        """InvalidArgument unless ``fd`` is a regular file, PermissionDenied unless it is at the
        listed path (its real path as the kernel has it for the open file, not as the name
        resolved a moment earlier)."""
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidArgument(f"{file.location} is not a regular file")
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != str(self.directory / file.name):
            raise PermissionDenied(f"{file.location} now resolves to {opened}: links are not followed")
