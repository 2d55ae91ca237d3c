"""Stop strings found in a bounded tail of the output, not by decoding all of it every token.

After each new token only a stop string that the new token completes can be new: one found
earlier would have ended generation then. Such a string ends inside the new token's bytes, so
it lies within the new token plus the ``window_bytes`` bytes before it, once ``window_bytes``
is at least the longest stop string's UTF-8 length. Decoding that tail costs the same at token
10 and at token 10,000. A tail that starts inside a multi-byte character decodes that
fragment as U+FFFD, before any stop string it holds, so matches are exactly those a decode of
the whole output finds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.runtime.sampling.request_validation import MAX_STOP_STRING_BYTES


def tail_bytes(token_ids: Sequence[int], token_bytes: Callable[[int], bytes], window_bytes: int) -> bytes:
    """The bytes of the last token of ``token_ids`` and of as many tokens before it as make up
    at least ``window_bytes`` bytes (all of them when the output is shorter)."""
    if not token_ids:
        return b""
    parts = [token_bytes(token_ids[-1])]
    index, needed = len(token_ids) - 2, window_bytes
    while needed > 0 and index >= 0:
        parts.append(token_bytes(token_ids[index]))
        needed -= len(parts[-1])
        index -= 1
    return b"".join(reversed(parts))


class StopStringTail:
    """The engine's ``detokenize`` for its stop-string check: output ids -> the tail of their
    text that can hold a stop string the newest token completed (any stop string the request
    validation admits, :data:`MAX_STOP_STRING_BYTES` bytes at most)."""

    def __init__(self, token_bytes: Callable[[int], bytes], window_bytes: int = MAX_STOP_STRING_BYTES):
        self._token_bytes = token_bytes
        self._window_bytes = window_bytes

    def __call__(self, output_ids: Sequence[int]) -> str:
        return tail_bytes(output_ids, self._token_bytes, self._window_bytes).decode("utf-8", errors="replace")
