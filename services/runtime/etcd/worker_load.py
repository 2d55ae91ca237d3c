"""The gpu_worker heartbeat, ``loramesh.v1.WorkerLoad``, as the JSON load report in etcd.

DESIGN §4 fixes the load report as JSON under ``/loramesh/load/<instance_id>``; WorkerLoad
types it. The JSON is protobuf's JSON mapping with the proto field names, so the keys stay the
ones every reader knows (``queue``, ``free_pages``, ``tokens_per_s``, ``ts``...) and
``loramesh status`` prints it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor, json_format

from mesh_api.v1.types_pb2 import WorkerLoad

_INT64_FIELDS = tuple(
    field.name
    for field in WorkerLoad.DESCRIPTOR.fields
    if field.type in (descriptor.FieldDescriptor.TYPE_UINT64, descriptor.FieldDescriptor.TYPE_INT64)
    and not field.is_repeated
)
"""Fields protobuf's JSON mapping writes as strings (64-bit integers)."""


def worker_load_to_report(load: WorkerLoad) -> dict[str, Any]:
    """The JSON-able load report of ``load`` (every field, zero ones included).

    64-bit integers stay numbers (JSON and Python have no 53-bit limit here, and parsing
    accepts them), so every number of the report is one for its readers and its gauges."""
    report = json_format.MessageToDict(
        load, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for name in _INT64_FIELDS:
        if name in report:
            report[name] = int(report[name])
    return report


def worker_load_from_report(report: Mapping[str, Any]) -> WorkerLoad:
    """Parse a load report; keys WorkerLoad does not know are ignored.

    Raises ``ValueError`` when a known key has a value of the wrong type or range.
    """
    try:
        return json_format.ParseDict(dict(report), WorkerLoad(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise ValueError(f"not a WorkerLoad report: {e}") from e
