"""One call of a function: made by the model in its reply, or found in the chat history."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    """A fresh call id, shaped as OpenAI's: ``call_`` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """A call of one function, as OpenAI's ``tool_calls`` entries carry it."""

    id: str
    """Pairs the call with its result (the ``tool`` message's ``tool_call_id``)."""
    name: str
    """The function called."""
    arguments: str
    """The arguments object as JSON text, exactly as the model wrote it."""

    def to_openai(self) -> dict[str, Any]:
        """The entry of a message's ``tool_calls``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
