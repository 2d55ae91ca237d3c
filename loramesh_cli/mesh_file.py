"""``<state dir>/mesh.json``: where a local mesh's services are, written by ``loramesh up``.

Other commands read it by default, so ``loramesh status`` or ``loramesh adapters list`` need
no addresses on the command line. The state directory is ``--state-dir``, else
``$LORAMESH_STATE_DIR``, else ``.loramesh`` (the SDK's ``Client()`` looks in the same place).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramesh.client import DEFAULT_STATE_DIR, MESH_FILE_NAME, STATE_DIR_ENV
from loramesh_cli.errors import CommandError
from services.runtime.security.private_files import private_dir, write_private_text
from services.runtime.security.tls import NO_TLS, TLSConfig


@dataclass
class ServiceEntry:
    """One process of the local mesh, as its supervisor last saw it."""

    address: str
    """gRPC ``host:port`` (for etcd: its client endpoint)."""
    http_address: str
    """``host:port`` of ``/healthz``, ``/readyz`` and ``/metrics``; empty for etcd."""
    pid: int
    """Its process id; 0 while it is down, waiting for its restart."""
    log: str
    """Its log file."""
    openai_address: str = ""
    """The gateway's OpenAI-compatible HTTP API (``host:port``; base URL ``http://<it>/v1``)."""
    restarts: int = 0
    """Times the supervisor of ``loramesh up`` started the process again after it died."""
    last_exit: str = ""
    """How its last run ended (``killed by signal 9``, ``exit code 1``); empty if it never died."""
    last_exit_unix: float = 0.0
    """When its last run ended (Unix time); 0 if it never died."""
    runs: str = ""
    """A gpu_worker's base weights' format and activation dtype in force (``weights q4_1
    (quantized blocks), activations bfloat16``), from its load report once the mesh was ready;
    empty for the other services, or when the worker had not reported yet."""


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
    """Every service process by name, which is also its instance id in etcd. The first replica of
    a kind has the kind's plain name (``gateway``, ``scheduler``), further ones ``<kind>-<i>``."""
    ready: bool = False
    gateway_addresses: list[str] = field(default_factory=list)
    """Every gateway's gRPC address; ``services["gateway"].address`` is the first of them."""
    etcd: ServiceEntry | None = None
    """etcd's process as supervised (``address`` is its client endpoint)."""
    tls: dict[str, str] = field(default_factory=dict)
    """With ``loramesh up --tls``: the mesh CA (``ca_file``), which every client checks the servers
    against, and the ``operator`` identity's ``cert_file`` and ``key_file``, which the CLI presents
    to the internal ports and etcd (a client of the gateways, the SDK, takes the CA alone); empty:
    the mesh runs in plaintext."""

    def tls_config(self) -> TLSConfig:
        """:attr:`tls` as the settings the CLI's channels and etcd client take."""
        if not self.tls:
            return NO_TLS
        return TLSConfig(self.tls["ca_file"], self.tls["cert_file"], self.tls["key_file"])

    @staticmethod
    def path(state_dir: Path) -> Path:
        return Path(state_dir) / MESH_FILE_NAME

    def write(self, state_dir: Path) -> None:
        """Replace the file atomically; it holds the admin API key, so only its owner may read it
        (0600, in a 0700 state directory)."""
        path = self.path(state_dir)
        private_dir(path.parent)
        write_private_text(path, json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, state_dir: Path) -> MeshFile | None:
        """The file in ``state_dir``; None when there is none. A :class:`CommandError` naming it
        when it is not what ``loramesh up`` writes."""
        path = cls.path(state_dir)
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            raw["services"] = {k: ServiceEntry(**v) for k, v in raw.get("services", {}).items()}
            if raw.get("etcd"):
                raw["etcd"] = ServiceEntry(**raw["etcd"])
            return cls(**raw)
        except (ValueError, TypeError, AttributeError) as error:
            raise CommandError(f"{path.absolute()} is not a mesh file of `loramesh up`: {error}") from None

    @classmethod
    def remove(cls, state_dir: Path) -> None:
        cls.path(state_dir).unlink(missing_ok=True)


def command_line(state_dir: Path, command: str) -> str:
    """``loramesh <command>`` as a hint prints it for the mesh in ``state_dir``: with
    ``--state-dir`` unless it is the built-in default, so the hint works pasted into a shell
    without ``$LORAMESH_STATE_DIR``."""
    if Path(state_dir) == DEFAULT_STATE_DIR:
        return f"loramesh {command}"
    return f"loramesh --state-dir {shlex.quote(str(state_dir))} {command}"


def why_not_live(state_dir: Path, mesh: MeshFile | None) -> str | None:
    """None when ``mesh`` (read from ``state_dir``) is run by a live ``loramesh up``; else why
    not, naming the file read."""
    path = MeshFile.path(state_dir).absolute()
    if mesh is None:
        return f"{path} does not exist"
    if not pid_alive(mesh.up_pid):
        return f"the `loramesh up` that wrote {path} (pid {mesh.up_pid}) is gone"
    return None


def live_mesh(state_dir: Path, alternative: str = "") -> MeshFile:
    """The mesh a live ``loramesh up`` runs from ``state_dir``, or a :class:`CommandError` saying
    why there is none (naming the file read), how to start one, and ``alternative`` (a flag that
    names a mesh directly, e.g. ``pass --gateway HOST:PORT``)."""
    mesh = MeshFile.read(state_dir)
    reason = why_not_live(state_dir, mesh)
    if reason is None:
        return mesh
    instead = f"{alternative}, " if alternative else ""
    raise CommandError(
        f"no mesh is up: {reason}; start one with `{command_line(state_dir, 'up --detach')}`, "
        f"{instead}or point --state-dir or ${STATE_DIR_ENV} at a running mesh's state directory"
    )


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process. A zombie (exited, not yet reaped by its parent)
    still answers ``kill(pid, 0)`` but runs nothing: it counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Linux: the state field of ``/proc/<pid>/stat`` is ``Z``. Elsewhere (no /proc): unknown, False."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name (field 2) is in parentheses and may contain spaces; the state follows it.
    return stat[stat.rindex(")") + 2 :].startswith("Z")
