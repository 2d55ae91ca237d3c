"""Where the adapter catalog's rows live in etcd: the store replicas write them
(``services.adapter_store.catalog_keys`` holds the whole layout), and the gateways read them to
list adapters without asking a store.

A row's value is JSON; besides the fields only the store reads, every row holds ``id``,
``owner``, ``name``, ``visibility`` (1 private, 2 public), ``base_model``, ``max_rank`` and
``created_ms``, which a listing shows, and ``version`` and ``sha256``, by which a request may name
one version of a name.
"""

from __future__ import annotations


def catalog_root(key_prefix: str) -> str:
    """The catalog's root key under the mesh's ``key_prefix``."""
    return f"{key_prefix}/adapter_store"


def catalog_rows(key_prefix: str) -> str:
    """The prefix of every row: ``rows/<id>``."""
    return f"{catalog_root(key_prefix)}/rows/"
