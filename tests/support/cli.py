"""Run the ``loramesh`` command as a user does: a child process on one state directory."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

COMMAND_TIMEOUT_S = 400
"""Not a timing claim: only turns a hung command into a named failure (``up`` starts nine
processes, which takes minutes on a busy 2-core machine)."""


def loramesh(
    state_dir: Path | str, *argv: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``loramesh --state-dir STATE_DIR ARGV...``; with ``check``, assert it exited 0 (the
    assertion shows its stderr). ``env``: variables set for it, on top of this process's."""
    done = subprocess.run(
        [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state_dir), *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=None if env is None else {**os.environ, **env},
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@contextlib.contextmanager
def supervised_mesh_up(
    state_dir: Path, dtype: str = "float32", deterministic: bool = False
) -> Iterator[Path]:
    """``loramesh up --detach`` of the whole mesh with every service replicated (two workers,
    gateways, schedulers and kv_managers, mutual TLS, fast restarts), the workers computing in
    ``dtype`` (batch-invariant with ``deterministic``), taken down on exit: what the failover and
    chaos suites kill processes in."""
    loramesh(
        state_dir, "up", "--detach", "--workers", "2", "--dtype", dtype, "--pool-mib", "64",
        "--gateways", "2", "--schedulers", "2", "--kv-managers", "2", "--restart-backoff-s", "0.2", "--tls",
        *(["--deterministic"] if deterministic else []),
    )  # fmt: skip
    try:
        yield state_dir
    finally:
        loramesh(state_dir, "down", check=False)
