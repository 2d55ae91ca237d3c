"""``.loramesh/mesh.json``: where a local mesh's services are, written by ``loramesh up``.

Other commands read it by default, so ``loramesh status`` or ``loramesh adapters list`` need
no addresses on the command line.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = Path(".loramesh")


@dataclass
class ServiceEntry:
    address: str
    http_address: str
    pid: int
    log: str


@dataclass
class MeshFile:
    """The local mesh as ``loramesh up`` started it."""

    up_pid: int
    """Process of ``loramesh up``; SIGTERM to it stops the whole mesh."""
    etcd_endpoint: str
    etcd_pid: int
    admin_api_key: str
    """API key of the local admin tenant (`admin`), accepted by the gateway."""
    services: dict[str, ServiceEntry] = field(default_factory=dict)
    ready: bool = False

    @staticmethod
    def path(state_dir: Path = DEFAULT_STATE_DIR) -> Path:
        return Path(state_dir) / "mesh.json"

    def write(self, state_dir: Path = DEFAULT_STATE_DIR) -> None:
        path = self.path(state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, state_dir: Path = DEFAULT_STATE_DIR) -> MeshFile | None:
        path = cls.path(state_dir)
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        raw["services"] = {k: ServiceEntry(**v) for k, v in raw.get("services", {}).items()}
        return cls(**raw)

    @classmethod
    def remove(cls, state_dir: Path = DEFAULT_STATE_DIR) -> None:
        cls.path(state_dir).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
