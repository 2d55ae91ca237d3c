"""Regenerate the committed Python stubs in ``loramesh/v1/`` from ``protos/loramesh/v1``.

``python -m loramesh.protogen [OUT_DIR]`` (``make protos``). A test runs it into a temp dir and
fails on any difference, so the committed stubs never drift from the protos.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "loramesh" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_root/loramesh/v1``."""
    import grpc_tools
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_root / "loramesh" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out_root):
        print(path)


if __name__ == "__main__":
    main()
