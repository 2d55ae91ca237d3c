"""A generated servicer added to a server with some of its requests read by the service's own
reader instead of protobuf's ``FromString``.

Why: a method whose requests carry bulk bytes (``RegisterAdapter``'s chunks) can read them as
views, where protobuf's parse copies them (:mod:`mesh_api.upload_wire`). The
generated ``add_*_to_server`` fixes every deserializer; this takes its handlers and replaces
the named methods' ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grpc
from grpc import aio

RequestReader = Callable[[bytes], object]
"""Reads one request's bytes; raises protobuf's ``DecodeError`` for bytes it cannot read (the
runtime's interceptor answers those ``INVALID_ARGUMENT``)."""


class _HandlerCapture:
    """Stands in for the server while a generated ``add_*_to_server`` hands over its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        """The generated code also registers its methods by name (below): those are the ones used."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = dict(handlers)


def add_servicer_with_readers(
    server: aio.Server,
    add_generated: Callable[[object, object], None],
    servicer: object,
    readers: Mapping[str, RequestReader],
) -> None:
    """``add_generated(servicer, server)``, except that each method named in ``readers`` (by its
    short name, ``"RegisterAdapter"``) reads its requests with that reader."""
    capture = _HandlerCapture()
    add_generated(servicer, capture)
    if len(capture.services) != 1:
        raise ValueError(f"{add_generated.__name__} registered {len(capture.services)} services, not one")
    ((service, handlers),) = capture.services.items()
    unknown = set(readers) - set(handlers)
    if unknown:
        raise ValueError(f"{service} has no method {sorted(unknown)}")
    for method, reader in readers.items():
        handlers[method] = handlers[method]._replace(request_deserializer=reader)  # grpc's is a namedtuple
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
