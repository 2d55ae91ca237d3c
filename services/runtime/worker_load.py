"""The gpu_worker heartbeat, ``loramesh.v1.WorkerLoad``, as the JSON load report in etcd.

DESIGN §4 fixes the load report as JSON under ``/loramesh/load/<instance_id>``; WorkerLoad
types it. The JSON is protobuf's JSON mapping with the proto field names, so the keys stay the
ones every reader knows (``queue``, ``free_pages``, ``tokens_per_s``, ``ts``...) and
``loramesh status`` prints it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from loramesh.v1.types_pb2 import WorkerLoad


def worker_load_to_report(load: WorkerLoad) -> dict[str, Any]:
    """The JSON-able load report of ``load`` (every field, zero ones included)."""
    return json_format.MessageToDict(
        load, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def worker_load_from_report(report: Mapping[str, Any]) -> WorkerLoad:
    """Parse a load report; keys WorkerLoad does not know are ignored.

    Raises ``ValueError`` when a known key has a value of the wrong type or range.
    """
    try:
        return json_format.ParseDict(dict(report), WorkerLoad(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise ValueError(f"not a WorkerLoad report: {e}") from e
