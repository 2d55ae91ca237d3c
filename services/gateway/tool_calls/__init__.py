"""Tool calls for chat requests (OpenAI's ``tools``), independent of any wire format.

A front end uses it in this order:

1. :func:`parse_tool_request` reads the request's ``tools``, ``tool_choice`` and
   ``parallel_tool_calls`` (None: no tools offered), and :func:`parse_message_tool_calls` each
   assistant message's ``tool_calls``, for the :class:`ChatMessage` history.
2. The gateway core renders the prompt (:meth:`GatewayCore.chat_prompt`, which uses
   :func:`template_input`) with the adapter's chat template.
3. :func:`call_schema` is the JSON Schema decoding must follow (``required`` or a named
   function); None for ``auto``.
4. The reply: :func:`parse_reply` for a whole one, :class:`ToolCallStream` for a stream.
"""

from services.gateway.tool_calls.chat_message import ChatMessage, parse_message_tool_calls
from services.gateway.tool_calls.constraint import call_schema
from services.gateway.tool_calls.output_stream import ToolCallStream
from services.gateway.tool_calls.parsed_reply import ParsedReply, parse_reply
from services.gateway.tool_calls.prompt import TemplateInput, template_input
from services.gateway.tool_calls.tool_call import ToolCall
from services.gateway.tool_calls.tool_request import FunctionTool, ToolRequest, parse_tool_request

__all__ = [
    "ChatMessage",
    "FunctionTool",
    "ParsedReply",
    "TemplateInput",
    "ToolCall",
    "ToolCallStream",
    "ToolRequest",
    "call_schema",
    "parse_message_tool_calls",
    "parse_reply",
    "parse_tool_request",
    "template_input",
]
