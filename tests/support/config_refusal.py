"""A service's refusal of its settings, as ``python -m services.<name>`` prints it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from services.runtime.config import ServiceConfig, parse_config

PROG = "service"
"""The program name the refusal is printed under."""


def refusal(
    capsys: pytest.CaptureFixture[str],
    config: type[ServiceConfig],
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> str:
    """The one error line of parsing ``argv`` and ``environ`` into ``config``, which must refuse
    them argparse's way (exit status 2), without its ``service: error:`` prefix."""
    with pytest.raises(SystemExit) as exit_:
        parse_config(config, argv, environ=environ or {}, prog=PROG)
    assert exit_.value.code == 2
    prefix = f"{PROG}: error: "
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith(prefix)]
    return line.removeprefix(prefix)
