"""Start, stop and restart a local single-member etcd (3.4+) as a child process.

Used by the test fixtures and by ``loramesh up``. The server listens on loopback only, keeps its
data in ``data_dir`` (``data_dir/member``) and writes its log to ``data_dir/etcd.log``. It is
stopped by PID (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

from services.runtime.process.child_environment import child_environment
from services.runtime.process.ports import free_port
from services.runtime.security.private_files import private_dir
from services.runtime.security.tls import NO_TLS, TLSConfig

log = logging.getLogger("loramesh.etcd_server")

LOG_NAME = "etcd.log"


class EtcdStartError(RuntimeError):
    """etcd could not be started or did not become healthy in time (message has the log tail)."""


@dataclass
class EtcdServer:
    """A single-member etcd cluster run as a child process.

    Ports left at 0 are chosen free at the first :meth:`start` and then kept, so that
    :meth:`restart` comes back on the same endpoint with the same data.
    """

    data_dir: Path
    """etcd ``--data-dir``; created if missing. The log file ``etcd.log`` is written here too."""
    client_port: int = 0
    """Client (gRPC + HTTP) port; 0 picks a free one."""
    peer_port: int = 0
    """Raft peer port; 0 picks a free one."""
    host: str = "127.0.0.1"
    """Address both listeners bind to."""
    name: str = "default"
    """Member name (``--name``)."""
    binary: str = "etcd"
    """etcd executable (looked up on PATH)."""
    start_timeout_s: float = 20.0
    """How long :meth:`start` waits for ``/health`` to answer before giving up."""
    extra_args: tuple[str, ...] = ()
    """Further command-line flags passed to etcd as they are."""
    tls: TLSConfig = NO_TLS
    """Mutual TLS for clients: etcd serves ``https`` with this certificate and key and, with
    ``--client-cert-auth``, accepts only clients whose certificate the CA signed (the health
    check presents the same certificate). Off: plaintext. Peers (one member here) stay on http."""

    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener, the form :class:`MembershipConfig` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls.enabled else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or None when it is not running."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """Exit status of an etcd that ended by itself (negative: killed by that signal); None
        while it runs, and after :meth:`stop` or :meth:`kill` (those forget the process)."""
        return self._proc.poll() if self._proc is not None else None

    # -- lifecycle ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The etcd command line for the current configuration."""
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            *self._tls_args(),
            *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if not self.tls.enabled:
            return []
        return [
            "--client-cert-auth",
            "--trusted-ca-file", self.tls.ca_file,
            "--cert-file", self.tls.cert_file,
            "--key-file", self.tls.key_file,
        ]  # fmt: skip

    def start(self) -> Self:
        """Launch etcd and wait until ``/health`` reports healthy. Returns ``self``.

        Raises :class:`EtcdStartError` (with the end of the log) when etcd exits early or does
        not become healthy within ``start_timeout_s``. When the ports were picked automatically
        and etcd could not bind them (another process took them), new ports are tried.
        """
        if self.running:
            return self
        if shutil.which(self.binary) is None:
            raise EtcdStartError(
                f"etcd executable {self.binary!r} not found on PATH (Debian: apt-get install etcd-server)"
            )
        auto_ports = self.client_port == 0 or self.peer_port == 0
        attempts = 3 if auto_ports else 1
        for attempt in range(attempts):
            if self.client_port == 0:
                self.client_port = free_port(self.host)
            if self.peer_port == 0:
                self.peer_port = free_port(self.host)
            try:
                self._launch()
                return self
            except EtcdStartError as e:
                if attempt + 1 < attempts and "address already in use" in str(e):
                    log.warning("etcd ports taken, retrying with new ones: %s", e)
                    self.client_port = self.peer_port = 0
                    continue
                raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        private_dir(self.data_dir)  # etcd itself asks for 0700
        self._close_log()
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open while etcd runs
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=etcd_environment(os.environ),
            start_new_session=True,
        )
        log.info("etcd started pid=%s endpoint=%s data_dir=%s", self._proc.pid, self.endpoint, self.data_dir)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self._proc = None
                self._close_log()
                raise EtcdStartError(f"etcd exited with code {rc} during start-up:\n{self.log_tail()}")
            if self.healthy(timeout_s=0.5):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise EtcdStartError(
                    f"etcd at {self.endpoint} not healthy after {self.start_timeout_s:.0f}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when ``GET /health`` answers ``{"health": "true"}`` (the member has a leader)."""
        context = None
        if self.tls.enabled:
            context = ssl.create_default_context(cafile=self.tls.ca_file)
            context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=timeout_s, context=context
            ) as resp:
                body = json.loads(resp.read() or b"{}")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return str(body.get("health")).lower() == "true"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM etcd by PID and wait; SIGKILL it if it has not exited within ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("etcd pid=%s ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        log.info("etcd pid=%s stopped (rc=%s)", proc.pid, proc.returncode)
        self._proc = None
        self._close_log()

    def kill(self) -> None:
        """SIGKILL etcd by PID (a crash: no graceful shutdown) and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        log.info("etcd pid=%s killed", proc.pid)
        self._proc = None
        self._close_log()

    def restart(self, *, wipe: bool = False) -> Self:
        """Stop and start again on the same ports; with ``wipe`` the data is deleted in between
        (a brand-new cluster: every key and lease is gone)."""
        self.stop()
        if wipe:
            self.wipe()
        return self.start()

    def wipe(self) -> None:
        """Delete etcd's data (``data_dir/member``); only while stopped. The log is kept."""
        if self.running:
            raise RuntimeError("wipe() needs etcd stopped")
        shutil.rmtree(self.data_dir / "member", ignore_errors=True)

    def log_tail(self, n_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no etcd log)"
        return "\n".join(lines[-n_lines:])

    def _close_log(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


ETCD_VARIABLES = frozenset({"ETCD_UNSUPPORTED_ARCH"})
"""etcd's own variables passed on: the one a platform may need to run it at all. Others would
override the flags this module chose (etcd reads every ``ETCD_*`` variable as a flag)."""


def etcd_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What etcd is started with: the system's variables alone (no ``LORAMESH_*`` settings, no
    cloud credentials; :func:`~services.runtime.process.child_environment.child_environment`),
    plus :data:`ETCD_VARIABLES`."""
    env = child_environment(environ, "etcd", settings=())
    env.update((name, environ[name]) for name in ETCD_VARIABLES if name in environ)
    return env
