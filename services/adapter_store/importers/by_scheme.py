"""The importer for a URI's scheme.

Each importer's module is imported when a URI of its scheme is first imported: the Hub's and
S3's client libraries took most of a store's start-up (2.5 s and 0.8 s of 7.5 s under load),
which every start and restart paid though most stores import nothing.
"""

from __future__ import annotations

import importlib

from services.adapter_store.importers.source import AdapterImportSource
from services.adapter_store.importers.source_scope import scheme_of

SOURCES: dict[str, tuple[str, str]] = {
    "s3": ("services.adapter_store.importers.s3", "S3Source"),
    "hf": ("services.adapter_store.importers.hf", "HubSource"),
    "file": ("services.adapter_store.importers.file", "FileSource"),
}
"""Each scheme's importer: its module and class."""


def source_class(scheme: str) -> type[AdapterImportSource]:
    module, name = SOURCES[scheme]
    return getattr(importlib.import_module(module), name)


def open_source(uri: str) -> AdapterImportSource:
    return source_class(scheme_of(uri))(uri)
