"""One call of any gRPC method with requests already serialized, and how its outcome reads."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import MethodDescriptor

STREAM_REPLIES = 8
"""Replies read from a response stream before the call is cancelled."""
ENDLESS = {"grpc.health.v1.Health.Watch", "loramesh.v1.AdapterStore.WatchAdapters"}
"""Response streams that never end by design (a state, then each change): cancelled after
their first reply."""
UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
"""Codes that say the server failed rather than why the request was refused."""


def call(
    channel: grpc.Channel, method: MethodDescriptor, requests: list[bytes], metadata, timeout_s: float
) -> tuple[grpc.StatusCode, str, bytes]:
    """``(code, details, reply bytes)`` of one call; a client-streaming method gets all of
    ``requests``, any other the first."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    args = (iter(requests),) if method.client_streaming else (requests[0],)
    kind = (
        ("stream" if method.client_streaming else "unary")
        + "_"
        + ("stream" if method.server_streaming else "unary")
    )
    callable_ = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    replies = []
    enough = 1 if method.full_name in ENDLESS else STREAM_REPLIES
    try:
        if method.server_streaming:
            stream = callable_(*args, metadata=metadata, timeout=timeout_s)
            for reply in stream:
                replies.append(reply)
                if len(replies) >= enough:
                    stream.cancel()
                    return grpc.StatusCode.OK, "", b"".join(replies)
            return stream.code(), stream.details() or "", b"".join(replies)
        reply = callable_(*args, metadata=metadata, timeout=timeout_s)
        return grpc.StatusCode.OK, "", reply
    except grpc.RpcError as error:
        return error.code(), error.details() or "", b"".join(replies)
