"""DistKV-LLM's worker side (the rManager): requests' KV blocks in block tables, local and
borrowed; lending this pool's free blocks to other workers and attending over them for their
queries (DistAttention); borrowing when the pool runs dry; DGFM's recalls; the traffic meter.

This module is the wing's interface: the rest of the worker imports DistKV only from here (an
import-linter contract in pyproject.toml). :class:`DistKv` builds one worker's parts; the other
names are the types that cross the boundary (the :class:`KvOverflow` the engine's KV
reservation calls when the pool runs dry, a request's :class:`BlockTable`, the creditor errors a
step may raise, the executor-side :class:`DistributedKv`). ``transport/`` holds its
adapters to other processes (gRPC, the same-host lane), which only the service wires up.
"""

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
from services.gpu_worker.distkv.shared_lender import SharedLender
from services.gpu_worker.distkv.wing import AUTO_LEND_SHARE, DistKv, DistKvSettings

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
