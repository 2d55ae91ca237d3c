"""Request fields no route knows: ignored, as vLLM ignores them (clients add fields faster than
servers), and logged once per name, so an operator sees what clients send that does nothing here
without one log line per request."""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("loramesh.gateway.openai")

MAX_LOGGED_NAMES = 1024
"""Names remembered at most: clients choose the names, so the set must not grow without end."""
MAX_NAME_CHARS = 64
"""Longest name logged and remembered as it is; longer ones are cut (a name may be megabytes)."""

_logged: set[str] = set()


def log_ignored(route: str, names: Iterable[str]) -> None:
    """Log each of ``names`` (fields ``route`` ignored) the first time any request sends it."""
    for name in sorted(names):
        shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."
        if shown in _logged or len(_logged) >= MAX_LOGGED_NAMES:
            continue
        _logged.add(shown)
        log.warning("ignoring request field %r on %s: not a field loramesh knows (logged once)", shown, route)
