"""Build a C kernel with the system compiler and load it with ``ctypes``: the native CPU kernels'
one toolchain (``cpu_native`` for LoRA, ``cpu_invariant`` for batch-invariant serving).

Sources are compiled once per source text/flags/compiler/CPU into a cache directory (``-march=native``
makes the library specific to the CPU it was built on), each flag set tried in order, under a
temporary name then renamed, so concurrent processes never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path.home() / ".cache" / "loramesh" / "kernels"
"""Where compiled kernels are kept."""


@dataclass(frozen=True)
class NativeBuild:
    """A compiled and loaded library, or why there is none."""

    library: ctypes.CDLL | None
    """The loaded library; None when it could not be built."""
    error: str
    """Why the build failed (compiler output, shortened); empty when it worked."""
    path: Path | None
    """The shared library loaded."""


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ""


def build_native(
    name: str,
    sources: Sequence[Path],
    flag_sets: Sequence[Sequence[str]],
    cache_dir: Path = CACHE_DIR,
    compiler: str = "cc",
    headers: Sequence[Path] = (),
) -> NativeBuild:
    """Compile ``sources`` (which include ``headers``) into ``cache_dir/name-<key>.so`` (or find it
    there) with the first of ``flag_sets`` that works, and load it; never raises."""
    try:
        texts = [path.read_bytes() for path in (*sources, *headers)]
        version = _compiler_version(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        return NativeBuild(None, f"no usable C compiler {compiler!r}: {exc}", None)
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(
            b"\0".join([*texts, " ".join(flags).encode(), version.encode(), cpu_signature().encode()])
        ).hexdigest()[:24]
        path = cache_dir / f"{name}-{key}.so"
        if not path.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
            os.close(fd)
            result = subprocess.run(
                [compiler, *flags, *map(str, sources), "-o", tmp],
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{compiler} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                continue
            os.replace(tmp, path)
        try:
            return NativeBuild(ctypes.CDLL(str(path)), "", path)
        except OSError as exc:
            errors.append(f"loading {path}: {exc}")
    return NativeBuild(None, "; ".join(errors), None)
