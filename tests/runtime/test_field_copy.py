from dataclasses import dataclass

from mesh_api.v1 import scheduler_pb2 as pb
from services.runtime.field_copy import dataclass_of, message_of


@dataclass(frozen=True)
class Placed:
    worker_id: str
    address: str
    estimated_wait_ms: float
    adapter_resident: bool
    queue_wait_ms: float = 0.0


@dataclass(frozen=True)
class Asked:
    request_id: str
    exclude_workers: frozenset[str]
    adapter_bytes: int = 7


def test_a_message_takes_the_fields_of_the_same_names_and_leaves_the_others_unset():
    placed = Placed("w1", "host:1", 12.5, True, queue_wait_ms=3.0)
    assert message_of(pb.PlaceResponse, placed) == pb.PlaceResponse(
        worker_id="w1", address="host:1", estimated_wait_ms=12.5, adapter_resident=True
    )


def test_values_given_replace_or_add_fields():
    placed = Placed("w1", "host:1", 12.5, True)
    message = message_of(pb.PlaceResponse, placed, address="other:2", predicted_output_tokens=40)
    assert (message.address, message.predicted_output_tokens, message.worker_id) == ("other:2", 40, "w1")


def test_a_dataclass_takes_a_messages_fields_and_keeps_its_defaults_for_the_rest():
    message = pb.PlaceRequest(request_id="r", exclude_workers=["a", "b"], prompt_text="hi")
    asked = dataclass_of(Asked, message, exclude_workers=frozenset(message.exclude_workers))
    assert asked == Asked("r", frozenset({"a", "b"}), adapter_bytes=7)
