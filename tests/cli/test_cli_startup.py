"""The CLI starts without the serving stack: importing it loads no torch, scipy or scikit-learn
(seconds of CPU on every ``loramesh`` command, ``--version`` included). The configs it reads
name the workers' and scheduler's settings from light modules; this guards that chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "scipy", "sklearn")


def test_cli_import_loads_no_heavy_library():
    probe = f"import loramesh_cli.main, sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
