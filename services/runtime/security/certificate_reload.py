"""Certificates that rotate without a restart: the CA, certificate and key files of a process are
read again when they change, and every new TLS handshake uses what they hold now.

One :class:`CertificateFiles` per set of files in a process (:func:`certificate_files`), shared
by everything that presents or checks them:

- every gRPC server (services.runtime.security.tls.add_server_port) serves with
  ``grpc.dynamic_ssl_server_credentials``, whose fetcher gRPC calls at each new connection's
  handshake: it checks the files and hands gRPC the new certificate, key and CA when they
  changed. Connections already open keep the certificate they were set up with, so a stream in
  flight is never cut;
- the HTTP ports (the OpenAI port, the health/metrics side port) serve with
  :func:`server_ssl_context`, whose handshake callback checks the files the same way and swaps
  the connection onto a context holding what they hold now;
- client channels (services.runtime.security.tls.aio_channel / sync_channel) check at most once every
  :data:`CHANNEL_CHECK_INTERVAL_S` seconds, at a call; a change opens a new channel with the new
  client certificate for the calls that follow, while calls already running finish on the old
  one (closed once they are done).

A check reads the three files and compares a hash of their content with what is in use; a new
set is taken only when it is whole (the certificate and the CA parse, the key is the
certificate's), so files replaced one by one, or half written, leave the previous set in use
until the next check finds them complete. Nothing here sleeps or polls in the background: the
handshakes and the calls drive the checks, and :func:`check_all` runs one now.
"""

from __future__ import annotations

import datetime
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from services.runtime.reloaded_files import ReloadedFiles

log = logging.getLogger("loramesh.tls")

#: How often a client channel looks at its files (at most; only when it makes a call). Servers
#: look at every handshake.
CHANNEL_CHECK_INTERVAL_S = 1.0

Clock = Callable[[], float]


class CertificateError(ValueError):
    """The files do not hold a usable set: a CA, a certificate, and the certificate's key."""


@dataclass(frozen=True)
class CertificateSet:
    """One consistent read of the files, as PEM bytes."""

    ca: bytes
    cert: bytes
    key: bytes
    generation: int
    """1 for the set read at start, one more at each change taken since."""

    @property
    def serial(self) -> int:
        """The serial number of the certificate (the first of its chain)."""
        return x509.load_pem_x509_certificate(self.cert).serial_number


def _validate(ca: bytes, cert: bytes, key: bytes) -> None:
    """Raise :class:`CertificateError` unless the CA and certificate parse and ``key`` is the
    certificate's private key."""
    try:
        x509.load_pem_x509_certificates(ca)
        leaf = x509.load_pem_x509_certificates(cert)[0]
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError, IndexError) as error:
        raise CertificateError(f"unreadable PEM: {error}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if private.public_key().public_bytes(encoding, public) != leaf.public_key().public_bytes(
        encoding, public
    ):
        raise CertificateError("the key is not the certificate's")


def _warn_if_expired(path: Path, cert: bytes) -> None:
    """Peers refuse an expired certificate at the handshake: say so where the operator looks."""
    leaf = x509.load_pem_x509_certificates(cert)[0]
    now = datetime.datetime.now(datetime.UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        log.warning(
            "TLS certificate %s is not valid now (valid %s to %s): peers will refuse it; replace "
            "the file (it is reloaded without a restart)",
            path, leaf.not_valid_before_utc, leaf.not_valid_after_utc,
        )  # fmt: skip


def _certificate_set(contents: tuple[bytes, ...], generation: int) -> CertificateSet:
    ca, cert, key = contents
    _validate(ca, cert, key)
    return CertificateSet(ca, cert, key, generation)


class CertificateFiles:
    """The CA, certificate and key files of one identity, and the set of them in use
    (:class:`~services.runtime.reloaded_files.ReloadedFiles`, which the tenants file uses too).

    Thread-safe: gRPC's fetcher runs on gRPC's threads, blocking channels on worker threads.
    """

    def __init__(self, ca_file: str, cert_file: str, key_file: str, clock: Clock = time.monotonic):
        self._files = ReloadedFiles((ca_file, cert_file, key_file), _certificate_set, "the TLS files", clock)
        self.paths = self._files.paths
        _warn_if_expired(self.paths[1], self.current.cert)

    @property
    def current(self) -> CertificateSet:
        return self._files.current

    def check(self) -> bool:
        """Read the files now; take them when they changed and are whole. Whether a new set
        was taken. Never raises: files missing or half replaced leave the current set in use."""
        previous = self._files.current
        if not self._files.check():
            return False
        current = self._files.current
        log.info(
            "TLS certificate reloaded from %s: serial %x -> %x",
            self.paths[1],
            previous.serial,
            current.serial,
        )
        _warn_if_expired(self.paths[1], current.cert)
        return True

    def poll(self, max_age_s: float = 0.0) -> CertificateSet:
        """The set in use, after a :meth:`check` unless one ran in the last ``max_age_s``."""
        if max_age_s <= 0 or self._files.due(max_age_s):
            self.check()
        return self._files.current


_registry: dict[tuple[str, str, str], CertificateFiles] = {}
_registry_lock = threading.Lock()


def certificate_files(ca_file: str, cert_file: str, key_file: str) -> CertificateFiles:
    """The process's one :class:`CertificateFiles` for these paths (made on first use: the files
    must then hold a whole set)."""
    key = tuple(str(Path(p).absolute()) for p in (ca_file, cert_file, key_file))
    with _registry_lock:
        files = _registry.get(key)
        if files is None:
            files = _registry[key] = CertificateFiles(*key)
            return files
    files.check()  # what a new server or channel starts with is what the files hold now
    return files


def check_all() -> int:
    """Check every set of files in this process now (rather than at the next handshake or call,
    e.g. right after replacing them); how many changed."""
    with _registry_lock:
        everything = list(_registry.values())
    return sum(files.check() for files in everything)


class ReloadingSSLContext:
    """A server-side :class:`ssl.SSLContext` (:attr:`context`, what the server is given) whose
    handshakes use the files' current certificate, key and CA: at each ClientHello its callback
    checks the files and moves the connection onto a context built from them."""

    def __init__(self, files: CertificateFiles, verify_mode: ssl.VerifyMode, alpn: tuple[str, ...] = ()):
        self._files = files
        self._verify_mode = verify_mode
        self._alpn = alpn
        self._lock = threading.Lock()
        self.context = self._build(files.current)
        self._live = self.context
        self._generation = files.current.generation
        self.context.sni_callback = self._on_client_hello

    def _build(self, certificates: CertificateSet) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = self._verify_mode
        context.load_verify_locations(cadata=certificates.ca.decode())
        # ssl loads a key only from a file: the files themselves (load_cert_chain refuses a key
        # that is not the certificate's, so a set replaced since the check is never half used).
        _, cert_path, key_path = self._files.paths
        context.load_cert_chain(cert_path, key_path)
        if self._alpn:
            context.set_alpn_protocols(list(self._alpn))
        return context

    def _on_client_hello(self, connection, server_name, context) -> None:  # no alert: go on
        certificates = self._files.poll()
        with self._lock:
            if certificates.generation != self._generation:
                try:
                    self._live = self._build(certificates)
                    self._generation = certificates.generation
                except (ssl.SSLError, OSError) as error:
                    log.warning("cannot load the new TLS certificate (%s): keeping the one in use", error)
            live = self._live
        if live is not context:
            connection.context = live


def server_ssl_context(
    ca_file: str, cert_file: str, key_file: str, require_client_cert: bool = False, alpn: tuple[str, ...] = ()
) -> ssl.SSLContext:
    """A server :class:`ssl.SSLContext` presenting ``cert_file`` and reloading it (and the key,
    and the CA) when the files change. A client certificate is asked for and, when one is
    presented, verified against the CA (an expired or foreign one fails the handshake); it is
    required only with ``require_client_cert``."""
    files = certificate_files(ca_file, cert_file, key_file)
    mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ReloadingSSLContext(files, mode, alpn).context


def certificate_expiries() -> dict[str, float]:
    """When the certificate in use of each set of files in this process expires (Unix seconds),
    by its certificate file: what ``/metrics`` shows for the expiry alert."""
    with _registry_lock:
        everything = list(_registry.values())
    return {
        str(files.paths[1]): x509.load_pem_x509_certificates(files.current.cert)[
            0
        ].not_valid_after_utc.timestamp()
        for files in everything
    }
