"""loramesh: serve many LoRA adapters of one base LLM from a mesh of gRPC services.

The client SDK (see ``docs/sdk.md``)::

    from loramesh import Client

    with Client("127.0.0.1:50050", api_key="sk-...") as client:
        print(client.generate("Hello,", max_tokens=16).text)

Importing the package stays light: the clients (and grpc) load on first use of
:class:`Client` or :class:`AsyncClient`. The gRPC stubs are the ``mesh_api`` package, which this
SDK and the servers both install; the SDK imports nothing of the servers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loramesh.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    LoraMeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StreamInterrupted,
    Unauthenticated,
    Unavailable,
)
from loramesh.types import (
    Adapter,
    AdapterPage,
    Completion,
    ImportedAdapter,
    Model,
    PublishedVersion,
    Sampling,
    ServedVersion,
    TextDelta,
    Usage,
)
from mesh_api.version import VERSION as __version__

if TYPE_CHECKING:
    from loramesh.async_client import AsyncClient
    from loramesh.client import Client
    from loramesh.tls import ClientTLS

__all__ = [
    "Adapter",
    "AdapterPage",
    "AlreadyExists",
    "AsyncClient",
    "Client",
    "ClientTLS",
    "Completion",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "ImportedAdapter",
    "InternalError",
    "InvalidArgument",
    "LoraMeshError",
    "Model",
    "NotFound",
    "PermissionDenied",
    "PublishedVersion",
    "ResourceExhausted",
    "Sampling",
    "ServedVersion",
    "StreamInterrupted",
    "TextDelta",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "__version__",
]

_LAZY = {"Client": "loramesh.client", "AsyncClient": "loramesh.async_client", "ClientTLS": "loramesh.tls"}


def __getattr__(name: str) -> Any:
    """Loads :class:`Client`, :class:`AsyncClient` and :class:`ClientTLS` on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module 'loramesh' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
