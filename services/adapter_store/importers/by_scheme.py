"""The importer for a URI's scheme."""

from __future__ import annotations

from services.adapter_store.importers.file import FileSource
from services.adapter_store.importers.hf import HubSource
from services.adapter_store.importers.s3 import S3Source
from services.adapter_store.importers.source import AdapterImportSource
from services.adapter_store.importers.source_scope import scheme_of

SOURCES: dict[str, type[AdapterImportSource]] = {"s3": S3Source, "hf": HubSource, "file": FileSource}


def open_source(uri: str) -> AdapterImportSource:
    return SOURCES[scheme_of(uri)](uri)
