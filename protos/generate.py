"""Regenerate the committed Python stubs in ``mesh_api/v1/`` from ``protos/loramesh/v1``.

``python protos/generate.py [OUT_DIR]`` (``make protos``). A test runs it into a temp dir and
fails on any difference, so the committed stubs never drift from the protos.

The ``.proto`` tree stays ``loramesh/v1`` (the gRPC package every language sees); only the
Python stubs live in a package of their own, ``mesh_api``, which the SDK and the servers both
install. protoc names a stub's imports after the proto's path, so those imports are rewritten.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
STUB_PACKAGE_DIR = Path("mesh_api") / "v1"

_PROTO_IMPORT = re.compile(r"^from loramesh\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "loramesh" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_root/mesh_api/v1``."""
    import tempfile

    import grpc_tools
    from grpc_tools import protoc

    out_dir = out_root / STUB_PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw_root:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw_root}",
            f"--pyi_out={raw_root}",
            f"--grpc_python_out={raw_root}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        for raw in sorted((Path(raw_root) / "loramesh" / "v1").glob("*_pb2*.py*")):
            (out_dir / raw.name).write_text(_PROTO_IMPORT.sub("from mesh_api.v1 import ", raw.read_text()))
    return sorted(out_dir.glob("*_pb2*.py*"))


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out_root):
        print(path)


if __name__ == "__main__":
    main()
