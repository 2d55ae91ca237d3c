"""``python -m bench.gpu_checklist ...``: the checklist's command line (``cli.main``)."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as ``python3 bench/gpu_checklist``: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.gpu_checklist.cli import main

if __name__ == "__main__":
    main()
