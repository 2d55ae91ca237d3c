"""Files a process reads at start and again whenever their content changes, without a restart:
the TLS certificates (:mod:`services.runtime.security.certificate_reload`) and the tenants file
(:mod:`services.gateway.tenants_reload`).

A check reads the files and compares a hash of their content with what is in use; a new content
is taken only when it parses, so a file half written, or several replaced one by one, leave the
previous value in use until a later check finds them whole (the problem logged once). Nothing
here sleeps or polls in the background: the uses drive the checks (:meth:`ReloadedFiles.poll`,
at most once every ``max_age_s``), and :meth:`ReloadedFiles.check` runs one now.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger("loramesh.reload")

T = TypeVar("T")
Clock = Callable[[], float]
Parse = Callable[[tuple[bytes, ...], int], T]
"""The files' contents, in order, and the generation they would be -> the value; ``ValueError``
(naming what is wrong) when they are not a usable whole."""


def _digest(contents: tuple[bytes, ...]) -> bytes:
    hasher = hashlib.sha256()
    for part in contents:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.digest()


class ReloadedFiles(Generic[T]):
    """The value parsed from some files, read again when they change. Thread-safe."""

    def __init__(
        self, paths: Sequence[str | Path], parse: Parse[T], what: str, clock: Clock = time.monotonic
    ):
        """``what``: how the log names the files (e.g. "the TLS files"). The files must parse
        now: at start a bad file is an error, not something to wait out."""
        self.paths = tuple(Path(p) for p in paths)
        self.what = what
        self._parse = parse
        self._clock = clock
        self._lock = threading.Lock()
        contents = self._read()
        self.generation = 1
        """1 for the value read at start, one more at each change taken since."""
        self._current = parse(contents, self.generation)
        self._digest = _digest(contents)
        self._warned = ""
        """The last problem logged, so that one is logged once, not at every use."""
        self._checked_at = clock()

    @property
    def current(self) -> T:
        return self._current

    def _read(self) -> tuple[bytes, ...]:
        return tuple(path.read_bytes() for path in self.paths)

    def check(self) -> bool:
        """Read the files now; take them when they changed and parse. Whether a new value was
        taken. Never raises: files missing or half replaced leave the current value in use."""
        with self._lock:
            self._checked_at = self._clock()
            try:
                contents = self._read()
            except OSError as error:
                self._warn_once(f"cannot read {self.what} ({error}): keeping what is in use")
                return False
            digest = _digest(contents)
            if digest == self._digest:
                return False
            try:
                value = self._parse(contents, self.generation + 1)
            except ValueError as error:
                self._warn_once(f"{self.what} changed ({digest.hex()[:12]}) but cannot be used yet "
                                f"({error}): keeping what is in use")  # fmt: skip
                return False
            self._current, self._digest, self._warned = value, digest, ""
            self.generation += 1
        return True

    def due(self, max_age_s: float) -> bool:
        """No check ran in the last ``max_age_s``."""
        return self._clock() - self._checked_at >= max_age_s

    def poll(self, max_age_s: float = 0.0) -> T:
        """The value in use, after a :meth:`check` unless one ran in the last ``max_age_s``."""
        if max_age_s <= 0 or self.due(max_age_s):
            self.check()
        return self._current

    def _warn_once(self, message: str) -> None:
        if message != self._warned:
            self._warned = message
            log.warning("%s (%s)", message, ", ".join(str(p) for p in self.paths))
