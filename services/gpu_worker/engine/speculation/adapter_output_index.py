"""Drafts from an adapter's own recent outputs (``speculative: suffix``): an SQL adapter re-emits
the same clauses request after request, a support adapter its greetings and sign-offs, an RL
policy its earlier rollouts. What followed the latest earlier occurrence of a request's last
n tokens in those outputs is a draft, as prompt lookup drafts from the request's own tokens
(ArcticInference's suffix decoding; here an n-gram index of bounded depth, not a suffix tree).

Bounded: at most ``max_tokens`` output tokens are kept, the oldest outputs dropped first. An
index entry names the output it points into by its serial number; an entry into a dropped
output is a miss, deleted when met, and the whole map is rebuilt from the kept outputs when its
stale entries outnumber its live ones, so memory stays O(``max_tokens`` x n-gram sizes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class AdapterOutputIndex:
    """One adapter's recent outputs, for one tenant namespace (``adapter_indexes.py`` keys them)."""

    def __init__(self, max_tokens: int, max_ngram: int, min_ngram: int = 2):
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                "need max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                f"{max_tokens}, {min_ngram}, {max_ngram}"
            )
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._outputs: dict[int, tuple[int, ...]] = {}
        """Kept outputs by serial number (oldest first, insertion order)."""
        self._order: deque[int] = deque()
        self._next_serial = 0
        self.tokens = 0
        """Output tokens kept."""
        self._grams: dict[tuple[int, ...], tuple[int, int]] = {}
        """n-gram -> (serial, index of its last token) of its latest occurrence that has a token after it."""

    def add(self, output: Sequence[int]) -> None:
        """Keep one finished output (its last ``max_tokens`` tokens at most), dropping the oldest
        outputs beyond the bound."""
        output = tuple(output[-self.max_tokens :])
        if len(output) <= self.min_ngram:
            return  # no n-gram of it has a token after it
        serial, self._next_serial = self._next_serial, self._next_serial + 1
        self._outputs[serial] = output
        self._order.append(serial)
        self.tokens += len(output)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self._outputs.pop(self._order.popleft()))
        self._index(serial, output)
        if len(self._grams) > 2 * self.tokens * (self.max_ngram - self.min_ngram + 1):
            self._grams = {}
            for kept in self._order:
                self._index(kept, self._outputs[kept])

    def _index(self, serial: int, output: tuple[int, ...]) -> None:
        grams = self._grams
        for end in range(len(output) - 1):  # the last token has nothing after it to draft
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                grams[output[end - n + 1 : end + 1]] = (serial, end)

    def match(self, context: Sequence[int], k: int) -> tuple[int, tuple[int, ...]]:
        """(n, up to ``k`` tokens that followed the latest occurrence of ``context``'s last n
        tokens), the longest n found first; (0, ()) when none was."""
        if k <= 0:
            return 0, ()
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            gram = tuple(context[len(context) - n :])
            found = self._grams.get(gram)
            if found is None:
                continue
            output = self._outputs.get(found[0])
            if output is None:  # its output was dropped
                del self._grams[gram]
                continue
            return n, output[found[1] + 1 : found[1] + 1 + k]
        return 0, ()
