"""Prompt lookup (n-gram) drafting: the tokens that followed the last earlier occurrence of a
sequence's last n tokens are its likely next ones (vLLM's ``ngram`` method, llama.cpp's lookup
decoding). Output that quotes its prompt or repeats itself (an SQL rewrite re-emitting the
schema, a summary quoting its ticket) is drafted for free, without a draft model.

The index is built as the sequence grows, a few dict updates per token, so that a proposal
costs O(max_ngram) whatever the context length, not a scan of it every step.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (``min_ngram`` ≤ n ≤ ``max_ngram``) of one growing sequence last ended
    before its latest occurrence: what follows that earlier occurrence is the draft."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        """n-gram -> index of the last token of its latest occurrence."""
        self._earlier: dict[tuple[int, ...], int] = {}
        """n-gram -> the same for the occurrence before its latest one."""

    def sync(self, sequence: Sequence[int]) -> None:
        """Index the tokens of ``sequence`` (which extends what was indexed) not indexed yet."""
        for token in sequence[len(self.tokens) :]:
            self._append(token)

    def _append(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(token)
        end = len(tokens) - 1
        for n in range(self.min_ngram, min(self.max_ngram, len(tokens)) + 1):
            gram = tuple(tokens[end - n + 1 :])
            previous = self._latest.get(gram)
            if previous is not None:
                self._earlier[gram] = previous
            self._latest[gram] = end

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
        n tokens, the longest n that occurred before first (a longer match predicts better);
        () when none did."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, tuple[int, ...]]:
        """:meth:`propose`'s draft with the n it matched on; (0, ()) when none."""
        tokens = self.tokens
        if k <= 0:
            return 0, ()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self._earlier.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return n, tuple(tokens[end + 1 : end + 1 + k])
        return 0, ()
