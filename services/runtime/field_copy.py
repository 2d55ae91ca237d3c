"""Records copied field by field into another type whose fields have the same names.

The services translate between their domain dataclasses and the API's messages at the servicer.
Most of that is ``Message(a=x.a, b=x.b, ...)``; these write it once, and each conversion names
only what differs (a field renamed, computed, or of another type on the wire). A field the
source does not have is left to its default, so a field added to both sides travels at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
D = TypeVar("D")


def message_of(message_type: type[M], source: object, **values: Any) -> M:
    """A ``message_type`` with each field ``source`` has an attribute of the same name for
    taken from it, except those ``values`` give."""
    copied = {
        field.name: getattr(source, field.name)
        for field in message_type.DESCRIPTOR.fields
        if field.name not in values and hasattr(source, field.name)
    }
    return message_type(**copied, **values)


def dataclass_of(cls: type[D], source: object, **values: Any) -> D:
    """A ``cls`` (a dataclass) with each field ``source`` has an attribute of the same name for
    taken from it, except those ``values`` give."""
    copied = {
        field.name: getattr(source, field.name)
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
        if field.init and field.name not in values and hasattr(source, field.name)
    }
    return cls(**copied, **values)
