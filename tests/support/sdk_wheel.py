"""The SDK's own distribution (``sdk/``, ``loramesh-client``) as a user gets it: its wheel, built
offline from a copy of the tree, and a clean virtual environment holding that wheel and its
dependencies only, all without the network."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300
"""Not a timing claim: only turns a hung pip or venv into a named failure."""


def build_sdk_wheel(scratch: Path) -> Path:
    """The ``loramesh-client`` wheel, built offline in ``scratch`` from a copy of ``sdk/``,
    ``loramesh/``, ``mesh_api/`` and ``LICENSE`` (an in-tree build would leave build/ and
    egg-info in the checkout others work in)."""
    tree, out = scratch / "tree", scratch / "wheel"
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for part in ("sdk", "loramesh", "mesh_api"):
        shutil.copytree(REPO / part, tree / part, ignore=ignore)
    shutil.copy(REPO / "LICENSE", tree / "LICENSE")  # sdk/pyproject.toml's license-files
    return pip_wheel(tree / "sdk", out)


def pip_wheel(project: Path, out: Path) -> Path:
    """The wheel of the project in ``project``, built into ``out`` offline by this interpreter's
    pip, with its setuptools (no build isolation: nothing to fetch)."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(project)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("*.whl")
    return found


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist``."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or ()]


def dependency_closure(requirements: list[Requirement]) -> list[importlib.metadata.Distribution]:
    """The distributions of this interpreter that ``requirements`` need, transitively (markers
    evaluated here, no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        requirement = todo.pop()
        key = requirement.name.lower().replace("_", "-")
        if key in found:
            continue
        dist = importlib.metadata.distribution(requirement.name)
        assert dist.version in requirement.specifier, (requirement, dist.version)
        found[key] = dist
        for line in dist.requires or ():
            nested = Requirement(line)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    return list(found.values())


def link_distributions(dists: list[importlib.metadata.Distribution], into: Path) -> list[str]:
    """Symlinks in ``into`` to exactly these distributions' top-level modules and packages and
    their ``.dist-info`` (inside a namespace package such as ``google``, to its subpackages they
    installed: ``google/protobuf``, not the whole ``google``). Returns the linked names."""
    site = Path(sysconfig.get_paths()["purelib"])
    linked: set[str] = set()
    for dist in dists:
        for file in dist.files or ():
            parts = file.parts
            if parts[0] in ("..", "__pycache__") or parts[0].endswith(".dist-info"):
                continue
            namespace = len(parts) > 2 and not (site / parts[0] / "__init__.py").exists()
            linked.add("/".join(parts[:2] if namespace else parts[:1]))
        linked.add(Path(dist._path).name)  # its .dist-info, so pip and importlib.metadata see it
    for name in sorted(linked):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).symlink_to(site / name)
    return sorted(linked)


ISOLATED = """
import importlib.util, sys
assert sys.prefix != sys.base_prefix, "not in a virtual environment"
for absent in ("torch", "services", "loramesh_cli", "bench", "numpy", "safetensors"):
    assert importlib.util.find_spec(absent) is None, absent + " is importable"
import loramesh, mesh_api
for module in (loramesh, mesh_api):
    assert module.__file__.startswith(sys.prefix), module.__file__ + " is not the installed wheel's"
"""
"""Python that fails unless it runs in such a venv: the SDK from the wheel, nothing of the
repository or the servers' dependencies importable (prepend it to a script run there)."""


def clean_env() -> dict[str, str]:
    """This process's environment without ``PYTHON*`` variables or a virtual environment."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}


def sdk_venv(root: Path, wheel: Path) -> tuple[Path, list[str]]:
    """A new virtual environment in ``root/venv`` (no system site-packages) with ``wheel``
    installed by its own pip, offline; the wheel's dependencies come from this interpreter
    through a ``.pth`` file naming ``root/deps``, which holds links to them and nothing else.
    pip resolves the wheel's requirements against them (``--no-index``: nothing may be fetched).

    Returns:
        ``(the venv's python, the names linked into root/deps)``.
    """
    venv = root / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv / "bin" / "python"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    deps = root / "deps"
    deps.mkdir()
    linked = link_distributions(dependency_closure(wheel_requirements(wheel)), deps)
    venv_site = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=HANG_GUARD_S, env=clean_env(),
    ).stdout.strip()  # fmt: skip
    (Path(venv_site) / "loramesh-client-deps.pth").write_text(f"{deps}\n")
    installed = subprocess.run(
        [str(python), "-I", "-m", "pip", "install", "--no-index", "--no-cache-dir",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python, linked
