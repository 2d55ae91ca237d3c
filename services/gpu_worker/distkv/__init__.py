"""DistKV-LLM's worker side (the rManager): requests' KV blocks in block tables, local and
borrowed; lending this pool's free blocks to other workers and attending over them for their
queries (DistAttention); borrowing when the pool runs dry; DGFM's recalls; the traffic meter.

This module is the wing's interface: the rest of the worker imports DistKV only from here (an
import-linter contract in pyproject.toml). :class:`DistKv` builds one worker's parts; the other
names are the types that cross the boundary (the :class:`KvOverflow` the engine's KV
reservation calls when the pool runs dry, a request's :class:`BlockTable`, the creditor errors a
step may raise, the executor-side :class:`DistributedKv`). ``transport/`` holds its
adapters to other processes (gRPC, the same-host lane), which only the service wires up.

Each name loads its submodule at first use (PEP 562): the engine's config names
:class:`DistKvSettings` and the compute cap's defaults, and the CLI reads that config, so
importing the package must not import torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gpu_worker.distkv.block_recall import BlockRecalls
    from services.gpu_worker.distkv.block_table import BlockTable, RemoteBlock
    from services.gpu_worker.distkv.borrower import CreditorDirectory, TransportFactory
    from services.gpu_worker.distkv.distkv_meter import DistKvTotals
    from services.gpu_worker.distkv.distributed_kv import DistributedKv, DistributedSpan
    from services.gpu_worker.distkv.lend_compute_cap import (
        DEFAULT_LEND_COMPUTE_SHARE,
        DEFAULT_LEND_COMPUTE_WINDOW_S,
    )
    from services.gpu_worker.distkv.overflow import KvOverflow, Preemption
    from services.gpu_worker.distkv.remote_block_allocator import CreditorRefused, CreditorUnavailable
    from services.gpu_worker.distkv.rmanager import RManager
    from services.gpu_worker.distkv.settings import AUTO_LEND_SHARE, DistKvSettings
    from services.gpu_worker.distkv.shared_lender import SharedLender
    from services.gpu_worker.distkv.wing import DistKv

_SUBMODULES = {
    "AUTO_LEND_SHARE": "settings",
    "DEFAULT_LEND_COMPUTE_SHARE": "lend_compute_cap",
    "DEFAULT_LEND_COMPUTE_WINDOW_S": "lend_compute_cap",
    "BlockRecalls": "block_recall",
    "BlockTable": "block_table",
    "CreditorDirectory": "borrower",
    "CreditorRefused": "remote_block_allocator",
    "CreditorUnavailable": "remote_block_allocator",
    "DistKv": "wing",
    "DistKvSettings": "settings",
    "DistKvTotals": "distkv_meter",
    "DistributedKv": "distributed_kv",
    "DistributedSpan": "distributed_kv",
    "KvOverflow": "overflow",
    "Preemption": "overflow",
    "RManager": "rmanager",
    "RemoteBlock": "block_table",
    "SharedLender": "shared_lender",
    "TransportFactory": "borrower",
}
"""Exported name -> the submodule defining it. Loaded at first use (PEP 562) so that configs can
name the light ones (the settings, the compute cap's defaults) without importing torch."""

__all__ = [
    "AUTO_LEND_SHARE",
    "DEFAULT_LEND_COMPUTE_SHARE",
    "DEFAULT_LEND_COMPUTE_WINDOW_S",
    "BlockRecalls",
    "BlockTable",
    "CreditorDirectory",
    "CreditorRefused",
    "CreditorUnavailable",
    "DistKv",
    "DistKvSettings",
    "DistKvTotals",
    "DistributedKv",
    "DistributedSpan",
    "KvOverflow",
    "Preemption",
    "RManager",
    "RemoteBlock",
    "SharedLender",
    "TransportFactory",
]


def __getattr__(name: str) -> object:
    """The exported ``name``, its submodule imported on first use and the value kept here."""
    try:
        submodule = _SUBMODULES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the exported ones not yet loaded included."""
    return sorted({*globals(), *__all__})
