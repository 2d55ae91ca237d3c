"""A whole reply (not streamed) split into its text and its calls.

The same reading as a stream's (:class:`~.output_stream.ToolCallStream`), but a call is kept only
once it is complete and its JSON parses: a call the reply broke off (``finish_reason``
``length``) or that does not parse stays in the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.tool_calls.output_stream import ToolCallStream
from services.gateway.tool_calls.tool_call import ToolCall
from services.gateway.tool_calls.tool_request import ToolRequest


@dataclass(frozen=True)
class ParsedReply:
    """An assistant message's ``content`` and ``tool_calls``."""

    content: str | None
    """The text around the calls; None when there is none (OpenAI's ``null``)."""
    tool_calls: tuple[ToolCall, ...]
    """The calls, in the reply's order."""

    def finish_reason(self, reason: str) -> str:
        """The choice's ``finish_reason``, given the generation's: ``tool_calls`` when it stopped
        after making calls."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason


def parse_reply(text: str, request: ToolRequest) -> ParsedReply:
    """Split the whole reply ``text`` of a request that offered ``request``'s tools."""
    stream = ToolCallStream(request, incremental=False)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    return ParsedReply(content or None, stream.calls)
