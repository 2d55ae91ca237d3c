"""Incremental detokenization: token ids in, text deltas out, never splitting a UTF-8 character,
and stop strings honoured across token boundaries.

Byte-level BPE tokens are byte strings; one character may span several tokens. Bytes are held
back until they form complete UTF-8, and text that could still become the start of a stop
string is held back until it cannot — so a client never sees text past a stop string.

Each token costs the same however long the output is: only the new bytes are decoded, and the
stop strings are looked for in the new text plus what is held back, which is never more than
the longest stop string less one character (a stop string found in earlier text would have
ended the stream then).

What it returns depends only on the tokens, not on how they are grouped into :meth:`add`
calls, so feeding a stream's tokens again rebuilds its state at any point
(:mod:`services.gateway.continuation` continues a broken stream that way).
"""

from __future__ import annotations

from collections.abc import Callable


def _complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    end = len(data)
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte & 0b1100_0000 == 0b1000_0000:  # continuation byte: keep looking for the lead
            continue
        needed = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
        return end if back >= needed else end - back
    return end


class IncrementalDetokenizer:
    """Feed token ids with :meth:`add`; get the text that is safe to send."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop_strings: tuple[str, ...] = ()):
        self._token_bytes = token_bytes
        self._stops = tuple(s for s in stop_strings if s)
        self._pending = b""  # bytes not yet forming complete characters
        self._held = ""  # text held back because it may begin a stop string
        self.stopped = False
        """A stop string appeared; nothing after it will ever be returned."""

    def add(self, token_ids) -> str:
        """The text that these tokens complete and that cannot be part of a stop string."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self._pending += self._token_bytes(token_id)
        cut = _complete_utf8_prefix(self._pending)
        text = self._held + self._pending[:cut].decode("utf-8", errors="replace")
        self._pending = self._pending[cut:]
        found = [at for at in (text.find(stop) for stop in self._stops) if at >= 0]
        if found:  # the earliest, whichever stop string it is: as if fed one token at a time
            self.stopped = True
            self._held = ""
            return text[: min(found)]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: whatever is left (incomplete bytes decode as U+FFFD)."""
        if self.stopped:
            return ""
        text = self._held + self._pending.decode("utf-8", errors="replace")
        self._held, self._pending = "", b""
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[len(text) - length :]):
                    best = length
                    break
        return best
