"""The text parts catalog rows name (adapter configs, chat templates), read from the blob tier
once each and kept: a few distinct texts serve thousands of rows, and a row whose texts are
held decodes without touching the blob tier (the catalog's watch decodes on its event loop)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

MAX_TEXTS = 4096
"""Distinct texts held; beyond it the oldest go (read again when a row needs them)."""


class RowTexts:
    """Thread-safe ``digest -> text`` over ``read(digest)``."""

    def __init__(self, read: Callable[[str], str], max_texts: int = MAX_TEXTS):
        self._read = read
        self._max = max_texts
        self._texts: dict[str, str] = {}
        self._lock = threading.Lock()

    def holds(self, digests: Iterable[str]) -> bool:
        with self._lock:
            return all(digest in self._texts for digest in digests)

    def __call__(self, digest: str) -> str:
        with self._lock:
            text = self._texts.get(digest)
        if text is None:
            text = self._read(digest)
            with self._lock:
                if len(self._texts) >= self._max:
                    del self._texts[next(iter(self._texts))]
                self._texts[digest] = text
        return text
