"""Run the ``loramesh`` command as a user does: a child process on one state directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COMMAND_TIMEOUT_S = 400
"""Not a timing claim: only turns a hung command into a named failure (``up`` starts nine
processes, which takes minutes on a busy 2-core machine)."""


def loramesh(state_dir: Path | str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """``loramesh --state-dir STATE_DIR ARGV...``; with ``check``, assert it exited 0 (the
    assertion shows its stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "loramesh.cli.main", "--state-dir", str(state_dir), *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done
