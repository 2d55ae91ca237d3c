"""How the CLI reports a refusal: the reason on stderr and a non-zero exit."""

from __future__ import annotations


class CommandError(Exception):
    """A command cannot do what was asked; the message says why."""
