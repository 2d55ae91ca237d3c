"""JSON as the model wrote it: an object's members with their exact text, and the nesting depth
of text that arrives piece by piece.

A call's ``arguments`` are passed on as the model wrote them, not re-serialized: a stream hands
them out before they are complete, and the whole reply must give the same string.
"""

from __future__ import annotations

import json
import re
from typing import Any

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def object_members(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of the one JSON object ``text`` holds (whitespace around it allowed): key ->
    (value, the value's text as written); None when ``text`` is anything else."""
    at = _skip_space(text, 0)
    if not text.startswith("{", at):
        return None
    at = _skip_space(text, at + 1)
    members: dict[str, tuple[Any, str]] = {}
    if text.startswith("}", at):
        return members if _skip_space(text, at + 1) == len(text) else None
    try:
        while True:
            key, at = _DECODER.raw_decode(text, at)
            at = _skip_space(text, at)
            if not isinstance(key, str) or not text.startswith(":", at):
                return None
            start = _skip_space(text, at + 1)
            value, at = _DECODER.raw_decode(text, start)
            members[key] = (value, text[start:at])
            at = _skip_space(text, at)
            if text.startswith("}", at):
                break
            if not text.startswith(",", at):
                return None
            at = _skip_space(text, at + 1)
    except json.JSONDecodeError:
        return None
    return members if _skip_space(text, at + 1) == len(text) else None


def leading_json_value(text: str, start: int) -> str | None:
    """The text of the JSON object that begins at ``start`` (after any space), as written;
    None when no complete object begins there."""
    at = _skip_space(text, start)
    try:
        value, end = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return None
    return text[at:end] if isinstance(value, dict) else None


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


class BracketDepth:
    """The nesting depth of JSON text fed piece by piece; brackets inside strings do not count."""

    def __init__(self) -> None:
        self.depth = 0
        """Objects and arrays open at the end of the text fed so far."""
        self._in_string = False
        self._escaped = False

    def closings(self, text: str) -> list[tuple[int, int]]:
        """Feed ``text``: the offsets in it of the brackets that close an object or array, each
        with the depth after it."""
        found = []
        for offset, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                found.append((offset, self.depth))
        return found
