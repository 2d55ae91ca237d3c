"""Where a benchmark writes its raw results when no ``--out`` is given: ``bench/out/<name>/``
under the working directory (the repository root, where ``make bench`` and docs/benchmarks.md run
them), a folder git ignores, so a run leaves ``git status`` clean. What is committed of a run is
its summary, ``results.md`` and the plots, copied by hand into ``bench/results/<name>/``."""

from __future__ import annotations

from pathlib import Path


def default_out(name: str) -> Path:
    """The untracked folder of benchmark ``name``'s raw results: ``bench/out/<name>``."""
    return Path("bench/out") / name
