"""Adapter importers: one module per source scheme (``s3://``, ``hf://``, ``file://``) behind the
:class:`~services.adapter_store.importers.source.AdapterImportSource` interface. No gRPC in here: a
source only lists and reads files; registration is the repository's, the same as an upload's."""
