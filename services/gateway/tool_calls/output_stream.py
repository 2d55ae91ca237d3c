"""The model's reply, read as it is generated, turned into OpenAI's chat deltas: text and calls.

Under a constraint (``required``, a named function) the whole reply is one call,
``{"name": ..., "arguments": {...}}``. Under ``auto`` a reply is text with calls in it, each a
JSON object ``{"name": ..., "arguments": {...}}`` in ``<tool_call>...</tool_call>`` (Hermes'
format, which :mod:`.prompt` asks for), or one bare JSON object for the whole reply whose first
key is ``"name"`` (models trained on other formats write that).

A call is announced as soon as its name is known (``{"name": "<a tool>", "arguments": {`` has
been read): a ``tool_calls`` delta with its id, name and empty arguments; then its arguments
stream as they are generated, and their pieces join to exactly the arguments the model wrote.
Text streams as ``content`` deltas, except what could be the start of ``<tool_call>`` (held
until it is known not to be) and whitespace before a call (dropped).

A ``<tool_call>`` block that is not a call of a known tool (an unknown name, JSON that does not
parse) stays in the text, tags and all, as does a bare object that is not a call; in a block
that is one, what follows the arguments up to the closing tag is dropped. Once a call is
announced it is kept, even if the reply then stops in its arguments (``finish_reason``
``length``) or they turn out not to parse. With ``parallel_tool_calls`` false, calls after the
first are dropped, as OpenAI promises at most one.

``incremental=False`` reads a whole reply the same way, but keeps a call only once its
arguments are complete and parse (:func:`~.parsed_reply.parse_reply`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.tool_calls.json_text import BracketDepth, leading_json_value, object_members
from services.gateway.tool_calls.tool_call import ToolCall, new_call_id
from services.gateway.tool_calls.tool_request import ToolRequest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
"""A call's opening: its first member, ``"name"``, complete."""
_ARGUMENTS_NEXT = re.compile(r'\s*,\s*"arguments"\s*:\s*(?=\{)')
"""What follows the name in a call whose arguments can stream: ``, "arguments": {``."""

Delta = dict[str, Any]
"""One ``delta`` of a ``chat.completion.chunk`` choice."""


@dataclass
class _Block:
    """The call being read."""

    kind: Literal["tagged", "bare", "whole"]
    """``tagged``: in ``<tool_call>`` tags; ``bare``: a JSON object opening the reply; ``whole``:
    the whole (constrained) reply."""
    text: str = ""
    """Its text read so far (after the opening tag)."""
    space_before: str = ""
    """The space before the opening tag: text again if the block is not a call."""
    state: Literal["opening", "streaming", "dropped"] = "opening"
    """``opening``: not announced (its opening is being read, or it is read whole at its end);
    ``streaming``: announced, its arguments handed out as they come; ``dropped``: a call beyond
    the one ``parallel_tool_calls: false`` allows, read and dropped."""
    depth: BracketDepth = field(default_factory=BracketDepth)
    """Over :attr:`text` (``bare``): the object ends where its depth is back to 0."""
    arguments_depth: BracketDepth = field(default_factory=BracketDepth)
    """Over the arguments (``streaming``): they end where its depth is back to 0."""
    arguments_read: int = 0
    """Offset in :attr:`text` up to which the arguments were read and handed out."""
    arguments_done: bool = False
    """The arguments' closing ``}`` was read."""


class ToolCallStream:
    """One choice's reply, fed as text deltas, given out as OpenAI deltas. Feed every text delta
    to :meth:`feed`, then call :meth:`finish` once; send each returned delta in order."""

    def __init__(self, request: ToolRequest, *, incremental: bool = True):
        """``incremental``: announce a call and stream its arguments while they are generated;
        False: only once the call is complete and its JSON parses (a whole reply at once)."""
        self._request = request
        self._incremental = incremental
        self._announced: list[tuple[str, str]] = []  # (id, function) of each call announced
        self._arguments: list[str] = []  # each call's arguments handed out so far
        self._pending = ""  # text held back: space, or what may begin a tag
        self._block: _Block | None = _Block("whole") if request.constrained else None
        self._started = request.constrained  # past the reply's leading space

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls announced so far, each with its arguments read so far."""
        return tuple(ToolCall(i, name, args) for (i, name), args in zip(self._announced, self._arguments))

    def finish_reason(self, reason: str) -> str:
        """The choice's ``finish_reason``, given the generation's: ``tool_calls`` when it stopped
        after making calls."""
        return "tool_calls" if self._announced and reason == "stop" else reason

    def feed(self, text: str) -> list[Delta]:
        """The deltas ``text`` (the next piece of the reply) completes."""
        deltas: list[Delta] = []
        if self._block is not None:
            self._read_block(text, deltas)
        elif not self._started:
            self._read_opening(text, deltas)
        else:
            self._read_text(text, deltas)
        return deltas

    def finish(self) -> list[Delta]:
        """The deltas of what is still held, once the reply is complete."""
        deltas: list[Delta] = []
        block = self._block
        if block is not None:
            self._send_arguments(block, len(block.text), deltas)
            self._end_block(block, len(block.text), False, deltas)
        # Held space is dropped after calls; a held start of a tag was text after all.
        if self._pending.strip() or not self._announced:
            self._content(self._pending, deltas)
        self._pending = ""
        return deltas

    # -- text ----------------------------------------------------------------------------------

    def _read_opening(self, text: str, deltas: list[Delta]) -> None:
        """The reply's first non-space character decides: ``{`` may open a bare call."""
        self._pending += text
        if not self._pending.strip():
            return
        self._started = True
        held, self._pending = self._pending, ""
        if held.lstrip().startswith("{"):
            self._block = _Block("bare")
            self._read_block(held, deltas)
        else:
            self._read_text(held, deltas)

    def _read_text(self, text: str, deltas: list[Delta]) -> None:
        held, self._pending = self._pending + text, ""
        tag = held.find(TOOL_CALL_OPEN)
        if tag >= 0:
            before = held[:tag].rstrip()
            self._content(before, deltas)
            self._block = _Block("tagged", space_before=held[len(before) : tag])
            self._read_block(held[tag + len(TOOL_CALL_OPEN) :], deltas)
            return
        # Hold what could begin the tag, and trailing space (dropped if a call follows).
        end = len(held) - _tag_prefix_length(held)
        end = len(held[:end].rstrip())
        self._content(held[:end], deltas)
        self._pending = held[end:]

    @staticmethod
    def _content(text: str, deltas: list[Delta]) -> None:
        if text:
            deltas.append({"content": text})

    # -- calls ---------------------------------------------------------------------------------

    def _read_block(self, text: str, deltas: list[Delta]) -> None:
        block = self._block
        start = len(block.text)
        block.text += text
        end, closed = self._block_end(block, start)
        if block.state == "opening" and not self._open(block, end, deltas):
            self._block = None  # not a call: its text is the reply's, tags and all
            self._content(block.space_before + TOOL_CALL_OPEN if block.kind == "tagged" else "", deltas)
            self._read_text(block.text, deltas)
            return
        self._send_arguments(block, end, deltas)
        if closed:
            self._end_block(block, end, True, deltas)

    @staticmethod
    def _block_end(block: _Block, start: int) -> tuple[int, bool]:
        """Where the block's call text ends, as far as read, and whether it is complete."""
        if block.kind == "tagged":
            tag = block.text.find(TOOL_CALL_CLOSE, max(0, start - len(TOOL_CALL_CLOSE) + 1))
            if tag >= 0:
                return tag, True
        elif block.kind == "bare":
            for offset, depth in block.depth.closings(block.text[start:]):
                if depth == 0:
                    return start + offset + 1, True
        return len(block.text), False

    def _open(self, block: _Block, end: int, deltas: list[Delta]) -> bool:
        """Read the block's opening: announce the call once its name is known and its arguments
        begin; False when the block cannot be a call (an unknown function; a bare object whose
        first key is not ``"name"``)."""
        opening = _NAME_FIRST.match(block.text, 0, end)
        if opening is None:
            return block.kind != "bare" or _may_open_with_name(block.text[:end])
        name = _string(opening.group(1))
        if name is None or self._request.tool(name) is None:
            return block.kind == "whole"  # read whole, it becomes text at the end
        arguments = _ARGUMENTS_NEXT.match(block.text, opening.end(), end)
        if arguments is not None and self._incremental:
            block.arguments_read = arguments.end()
            if self._may_call():
                block.state = "streaming"
                self._announce(name, deltas)
            else:
                block.state = "dropped"
        return True

    def _send_arguments(self, block: _Block, end: int, deltas: list[Delta]) -> None:
        """Hand out the announced call's arguments read up to ``end``."""
        if block.state != "streaming" or block.arguments_done:
            return
        start, stop = block.arguments_read, end
        for offset, depth in block.arguments_depth.closings(block.text[start:end]):
            if depth == 0:
                stop, block.arguments_done = start + offset + 1, True
                break
        block.arguments_read = stop
        self._arguments_piece(block.text[start:stop], deltas)

    def _end_block(self, block: _Block, end: int, closed: bool, deltas: list[Delta]) -> None:
        """The block's call text ends at ``end`` (``closed``: by its closing tag or brace; else
        the reply ended); what follows is text again."""
        self._block = None
        if block.state == "opening":
            self._read_whole(block, end, closed, deltas)
        if block.kind == "whole":
            return
        after = end + len(TOOL_CALL_CLOSE) if closed and block.kind == "tagged" else end
        if block.text[after:]:
            self._read_text(block.text[after:], deltas)

    def _read_whole(self, block: _Block, end: int, closed: bool, deltas: list[Delta]) -> None:
        """A complete block never announced: a call if its JSON is one, else the reply's text."""
        call = self._call_in(block.text[:end])
        if call is None:
            if block.kind == "tagged":
                closing = TOOL_CALL_CLOSE if closed else ""
                self._content(block.space_before + TOOL_CALL_OPEN + block.text[:end] + closing, deltas)
            else:
                self._content(block.text[:end], deltas)
        elif self._may_call():
            name, arguments = call
            self._announce(name, deltas)
            self._arguments_piece(arguments, deltas)

    def _call_in(self, text: str) -> tuple[str, str] | None:
        """``(name, arguments text)`` when ``text`` opens with a JSON call of a known function
        (what follows the call is ignored, as a stream ignores it once the arguments are read).
        The arguments may come first, be under ``parameters`` (Llama 3's spelling) or be a
        string of JSON."""
        opening = _NAME_FIRST.match(text)
        arguments = _ARGUMENTS_NEXT.match(text, opening.end()) if opening else None
        if arguments is not None:
            name, written = _string(opening.group(1)), leading_json_value(text, arguments.end())
            return (name, written) if written and name and self._request.tool(name) is not None else None
        members = object_members(leading_json_value(text, 0) or "")
        name = members.get("name", (None, ""))[0] if members is not None else None
        if not isinstance(name, str) or self._request.tool(name) is None:
            return None
        value, written = members.get("arguments") or members.get("parameters") or (None, "")
        if isinstance(value, str) and object_members(value) is not None:
            return name, value
        return (name, written) if isinstance(value, dict) else None

    def _may_call(self) -> bool:
        return self._request.parallel_tool_calls or not self._announced

    def _announce(self, name: str, deltas: list[Delta]) -> None:
        call_id = new_call_id()
        self._announced.append((call_id, name))
        self._arguments.append("")
        function = {"name": name, "arguments": ""}
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": len(self._announced) - 1,
                        "id": call_id,
                        "type": "function",
                        "function": function,
                    }
                ]
            }
        )

    def _arguments_piece(self, piece: str, deltas: list[Delta]) -> None:
        if piece:
            self._arguments[-1] += piece
            deltas.append(
                {"tool_calls": [{"index": len(self._announced) - 1, "function": {"arguments": piece}}]}
            )


def _string(literal: str) -> str | None:
    """The value of a JSON string literal; None if it is not valid JSON (a bad escape)."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


def _tag_prefix_length(text: str) -> int:
    """Length of the longest end of ``text`` that begins :data:`TOOL_CALL_OPEN`."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def _may_open_with_name(text: str) -> bool:
    """Whether ``text`` (``{`` and what follows) may still be a call: its first key ``"name"``."""
    after_brace = text.lstrip()[1:].lstrip()
    return after_brace[:6] == '"name"'[: len(after_brace[:6])]
