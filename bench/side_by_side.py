"""Two ways of serving the same streaming load, measured in one run on one local mesh.

What ``gateway_overhead.py`` and ``openai_throughput.py`` share: the load flags, a mesh started
with ``loramesh up`` and stopped whatever happens, and rounds that alternate which path goes
first (so neither always runs on a warmer or a busier machine), reported as the median rate of
each path and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

from loramesh_cli.mesh_file import MeshFile


def load_arguments(description: str) -> argparse.ArgumentParser:
    """The flags every side-by-side bench takes; callers may add their own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--requests", type=int, default=16, help="concurrent streams per batch")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each stream generates")
    parser.add_argument("--rounds", type=int, default=3, help="batches per path")
    return parser


@contextlib.contextmanager
def local_mesh(workers: int = 2, flags: Sequence[str] = ()) -> Iterator[MeshFile]:
    """A mesh of ``workers`` float32 workers on loopback, in a fresh state directory; ``flags``:
    more of ``loramesh up``'s."""
    state = Path(tempfile.mkdtemp(prefix="lm-bench-"))
    cli = [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state)]
    subprocess.run(
        [
            *cli,
            "up",
            "--detach",
            "--workers",
            str(workers),
            "--dtype",
            "float32",
            "--pool-mib",
            "256",
            *flags,
        ],
        check=True,
    )
    try:
        yield MeshFile.read(state)
    finally:
        subprocess.run([*cli, "down"], check=False)
        shutil.rmtree(state, ignore_errors=True)  # its store's blobs and logs: 0.2 GB a run


async def alternating_rounds(
    paths: dict[str, Callable[[], Awaitable[int]]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Run each path once per round, in turn, the order reversed every other round. A path
    returns the tokens it generated; returned: tokens per second and tokens, per path."""
    rates: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, list[int]] = {name: [] for name in paths}
    names = list(paths)
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            count = await paths[name]()
            rates[name].append(count / (time.perf_counter() - started))
            tokens[name].append(count)
    return rates, tokens


def medians(rates: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in rates.items()}


def rounded(rates: dict[str, list[float]]) -> dict[str, list[float]]:
    return {name: [round(v, 1) for v in values] for name, values in rates.items()}
