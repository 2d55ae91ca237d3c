"""Typed service configuration from flags and environment.

Each service declares a dataclass that extends :class:`ServiceConfig`; every field becomes a
``--flag-name`` and a ``LORAMESH_FLAG_NAME`` environment variable (flag wins over env, env over
the default). The attribute docstring under each field is its ``--help`` text, so a field is
documented exactly once. Nothing is read at import time: :func:`parse_config` reads ``argv``
and ``environ`` when the service starts.

Settings fail closed: a value that does not parse (an on/off setting that is none of
:data:`TRUE_WORDS` or :data:`FALSE_WORDS`, a number that is not one) or that the config's
``__post_init__`` refuses (:func:`require_at_least` and its siblings: a count below 1, a port
out of range) stops the service before it starts, exit status 2 and one line naming the flag
and the variable, never a default in its place.

A service config may also take its settings from a dataclass its service builds (the worker's
engine limits: ``EngineConfig``) with :func:`settings_of`, so each is still declared once: in
that dataclass, and :func:`part_of` builds it back from the config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import logging
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, get_type_hints

from services.runtime.etcd.membership import DEFAULT_TTL_S, MembershipConfig, new_instance_id
from services.runtime.security.tls import TLSConfig

ENV_PREFIX = "LORAMESH_"

TRUE_WORDS = ("1", "true", "yes", "on")
"""How an on/off setting is turned on (any case); :data:`FALSE_WORDS` turn it off, and any
other value is refused rather than read as off."""
FALSE_WORDS = ("0", "false", "no", "off")
"""How an on/off setting is turned off (any case)."""
LOG_FORMATS = ("text", "json")
"""What ``--log-format`` takes."""

C = TypeVar("C", bound="ServiceConfig")
P = TypeVar("P")

SETTING = "loramesh.setting"
"""Key of a part's field metadata: the name of the service setting the field is (:func:`setting`)."""
DOC = "loramesh.doc"
"""Key of a field's metadata holding its docstring, for fields :func:`settings_of` adds (their
source is the part's, not the config's)."""


@dataclasses.dataclass
class ServiceConfig:
    """Settings every service has."""

    host: str = "127.0.0.1"
    """Interface the gRPC server and the HTTP side port bind to."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    http_port: int = 0
    """HTTP side port for /healthz, /readyz and /metrics; 0 picks a free one."""
    advertise_host: str = ""
    """Host other members use to reach this one (default: ``host``)."""
    etcd_endpoints: str = ""
    """Comma-separated etcd ``host:port`` list; empty runs without membership (standalone)."""
    lease_ttl_s: int = DEFAULT_TTL_S
    """TTL of the membership lease; a member that stops refreshing is gone after this, and a
    gpu_worker whose keepalives go unanswered for 2/3 of it takes no new requests."""
    instance_id: str = ""
    """Unique id of this instance in etcd (default: ``<service>-<random>``)."""
    grace_s: float = 10.0
    """On SIGTERM, how long in-flight RPCs may run before they are cancelled."""
    log_format: str = "text"
    """``text`` or ``json``."""
    log_level: str = "INFO"
    """Python logging level name."""
    freeze_startup_objects: bool = True
    """Once the service is ready, exempt every object alive (its model, tokenizer, libraries)
    from the garbage collector's full passes (``gc.freeze``), which otherwise traverse them all
    and stalled the worker's decode step by 73 to 130 ms each (services.runtime.process.garbage_collection).
    Applies to ``python -m services.<name>``, not to services started inside another process."""
    retain_freed_memory: bool = False
    """Keep freed buffers of up to 32 MiB in the process heap for reuse instead of returning
    them to the kernel (glibc ``mallopt``): no page faults for each megabyte-sized transient
    buffer, at the price of a heap that stays at its peak (services.runtime.process.allocator). On
    where adapter bytes pass through: the adapter store and the gateway."""
    tls_ca: str = ""
    """PEM of the mesh CA (``loramesh certs``); with ``tls_cert`` and ``tls_key`` turns on mutual
    TLS for this service's server, its channels to other services and to etcd. Empty: plaintext."""
    tls_cert: str = ""
    """PEM certificate of this service's identity (e.g. ``certs/gateway.pem``)."""
    tls_key: str = ""
    """PEM private key of ``tls_cert``."""
    tls_server_name: str = ""
    """Name peers' certificates are checked against instead of the dialled host (``mesh.loramesh``
    where members are dialled by IP, as in Kubernetes); empty: the dialled host."""

    def __post_init__(self) -> None:
        # A subclass with checks of its own calls this first: every service refuses these.
        for name in ("port", "http_port"):
            require_range(self, name, 0, 65535)
        require_at_least(self, 1, "lease_ttl_s")
        require_at_least(self, 0, "grace_s")
        require_choice(self, "log_format", LOG_FORMATS)
        require_choice(self, "log_level", tuple(logging.getLevelNamesMapping()), self.log_level.upper())

    def resolved_instance_id(self, service: str) -> str:
        return self.instance_id or new_instance_id(service)

    def tls(self) -> TLSConfig:
        """The mutual TLS settings every server, channel and etcd client of the service uses."""
        return TLSConfig(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)

    def required_membership(self, service: str, needed_for: str) -> MembershipConfig:
        """The etcd registry of a service that cannot run standalone (``needed_for``: what it
        finds there); a ValueError naming the flag when ``etcd_endpoints`` is empty."""
        if not self.etcd_endpoints:
            raise ValueError(
                f"the {service} needs --etcd-endpoints (env {ENV_PREFIX}ETCD_ENDPOINTS): {needed_for}"
            )
        return MembershipConfig(etcd_endpoints=self.etcd_endpoints, ttl_s=self.lease_ttl_s, tls=self.tls())


def setting_variable(name: str) -> str:
    """The environment variable of the setting ``name``: ``LORAMESH_NAME``."""
    return ENV_PREFIX + name.upper()


def setting_variables(cls: type[ServiceConfig]) -> frozenset[str]:
    """Every environment variable the config ``cls`` reads, one per setting."""
    return frozenset(setting_variable(f.name) for f in dataclasses.fields(cls))


def setting_names(name: str) -> str:
    """How a refusal names the setting ``name``: its flag and its environment variable."""
    return f"--{name.replace('_', '-')} (env {setting_variable(name)})"


def require_at_least(config: object, minimum: float, *names: str) -> None:
    """ValueError naming the first of the settings ``names`` of ``config`` below ``minimum``
    (NaN included: a setting that compares false everywhere is refused, not taken)."""
    for name in names:
        value = getattr(config, name)
        if not value >= minimum:
            raise ValueError(f"{setting_names(name)} must be at least {minimum}, got {value}")


def require_positive(config: object, *names: str) -> None:
    """ValueError naming the first of the settings ``names`` of ``config`` that is not more than 0."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{setting_names(name)} must be more than 0, got {value}")


def require_range(config: object, name: str, low: float, high: float) -> None:
    """ValueError naming the setting ``name`` of ``config`` unless it lies in [low, high]."""
    value = getattr(config, name)
    if not low <= value <= high:
        raise ValueError(f"{setting_names(name)} must be in [{low}, {high}], got {value}")


def require_choice(config: object, name: str, choices: Sequence[str], value: str | None = None) -> None:
    """ValueError naming the setting ``name`` of ``config`` unless its value (or ``value``, a
    normalised spelling of it) is one of ``choices``."""
    if (getattr(config, name) if value is None else value) not in choices:
        known = ", ".join(choices)
        raise ValueError(f"{setting_names(name)} must be one of {known}, got {getattr(config, name)!r}")


def setting(name: str | None) -> dict[str, str | None]:
    """Metadata of a part's field (``field(metadata=setting(...))``): the service setting is named
    ``name`` (its flag ``--name``) instead of the field's own name, or, with None, the field is no
    setting: the service derives it (e.g. the engine's worker id, from the instance id)."""
    return {SETTING: name}


def _setting_name(part_field: dataclasses.Field) -> str | None:
    return part_field.metadata.get(SETTING, part_field.name)


def settings_of(part: type) -> Callable[[type[C]], type[C]]:
    """Class decorator, under ``@dataclass``: the config takes each field of the dataclass
    ``part`` as a setting of its own (a flag, an env var, a keyword), with the field's type,
    default and docstring, under its :func:`setting` name. A name the config declares itself is
    refused: each setting has one declaration."""

    def add(cls: type[C]) -> type[C]:
        hints = get_type_hints(part)
        docs = field_docs(part)
        annotations = inspect.get_annotations(cls)
        for f in dataclasses.fields(part):
            if (name := _setting_name(f)) is None:
                continue
            if any(name in inspect.get_annotations(base) for base in cls.__mro__):
                raise TypeError(f"{cls.__name__}.{name} is declared by {part.__name__} already")
            annotations[name] = hints[f.name]
            setattr(cls, name, dataclasses.field(default=f.default, metadata={DOC: docs.get(f.name, "")}))
        cls.__annotations__ = annotations
        return cls

    return add


def part_of(config: ServiceConfig, part: type[P], **derived: Any) -> P:
    """``part`` built from the settings ``config`` took from it (:func:`settings_of`), and the
    fields that are no setting from ``derived``."""
    values = {f.name: getattr(config, name) for f in dataclasses.fields(part) if (name := _setting_name(f))}
    return part(**values, **derived)


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases (the string literal under a field, or the
    one :func:`settings_of` took from a part)."""
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    docs = {f.name: f.metadata[DOC] for f in fields if DOC in f.metadata}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def parse_bool(text: str) -> bool:
    """An on/off setting's value: one of :data:`TRUE_WORDS` or :data:`FALSE_WORDS`, in any case;
    ValueError for anything else (``enabled`` is no way to say on)."""
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected on ({', '.join(TRUE_WORDS)}) or off ({', '.join(FALSE_WORDS)}), got {text!r}")


_KIND_WORDS = {int: "an integer", float: "a number"}


def _converter(kind: Any) -> Callable[[str], Any]:
    """The function turning a flag's or variable's text into a ``kind`` value; its ValueError
    says what was expected (argparse shows an ArgumentTypeError's message as it is)."""
    if kind is str:
        return str
    if kind is bool:
        parse = parse_bool
    elif kind in _KIND_WORDS:

        def parse(text: str) -> Any:
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"expected {_KIND_WORDS[kind]}, got {text!r}") from None

    else:
        raise TypeError(f"config fields must be str, int, float or bool, not {kind!r}")

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


class SettingError(ValueError):
    """A setting's value the service cannot run with; the message is one line naming it."""


class _SettingsParser(argparse.ArgumentParser):
    """Raises :class:`SettingError` where argparse would print it and exit, so that both
    :func:`parse_config` (which then does) and :func:`read_config` (which does not) see it."""

    def error(self, message: str):  # type: ignore[override]
        raise SettingError(message)


_UNSET = object()
"""A flag's value when it is not on the command line (its variable or default applies)."""


def _settings_parser(cls: type[ServiceConfig], prog: str | None) -> _SettingsParser:
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    parser = _SettingsParser(prog=prog, description=(cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_converter(hints[f.name]),
            default=_UNSET,
            help=f"{docs.get(f.name, '')} [env {setting_variable(f.name)}; default {f.default!r}]",
        )
    return parser


def _config(
    cls: type[C], parser: _SettingsParser, argv: Sequence[str] | None, environ: Mapping[str, str]
) -> C:
    hints = get_type_hints(cls)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value, variable = getattr(args, f.name), setting_variable(f.name)
        if value is _UNSET and variable in environ:
            try:
                value = _converter(hints[f.name])(environ[variable])
            except argparse.ArgumentTypeError as error:
                raise SettingError(f"{variable} (setting --{f.name.replace('_', '-')}): {error}") from None
        values[f.name] = f.default if value is _UNSET else value
    try:
        return cls(**values)
    except ValueError as error:  # a config's own check (require_at_least...): one line naming it
        raise SettingError(str(error)) from None


def read_config(cls: type[C], argv: Sequence[str], environ: Mapping[str, str]) -> C:
    """``cls`` from the flags ``argv``, then the variables of ``environ``, then defaults, as the
    service would build it; :class:`SettingError` naming the first setting it would refuse (for
    a command that checks a service's settings before it starts it: `loramesh up`)."""
    return _config(cls, _settings_parser(cls, None), argv, environ)


def parse_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> C:
    """Build ``cls`` from command-line flags, then ``LORAMESH_*`` env vars, then defaults. A value
    that does not parse or that the config refuses exits with status 2 and one line naming the
    setting (its flag, and its variable when the value came from there)."""
    parser = _settings_parser(cls, prog)
    try:
        return _config(cls, parser, argv, os.environ if environ is None else environ)
    except SettingError as error:
        argparse.ArgumentParser.error(parser, str(error))
