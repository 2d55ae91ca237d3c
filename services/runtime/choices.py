"""Picking one of a fixed set of implementations by the name a flag or config gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def choose(choices: Mapping[str, T], name: str, what: str) -> T:
    """``choices[name]``; otherwise a ValueError that names ``what`` and every known name, so a
    mistyped flag says what it could have been."""
    try:
        return choices[name]
    except KeyError:
        known = ", ".join(sorted(choices))
        raise ValueError(f"unknown {what} {name!r}; known: {known}") from None
