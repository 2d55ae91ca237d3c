"""Options of a command derived from services' config classes (``services/*/config.py``).

`loramesh up` takes some of its services' settings as its own flags, under the service's flag
names, with the config field's type, docstring (its help) and default, and passes those it was
given on to the services; a setting it was not given is left to the service's default (or its
``LORAMESH_*`` variable, which each of its processes takes from `up`'s environment). Exposing
one more setting is adding its name to a :class:`ForwardedSettings`.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from services.runtime.config import ServiceConfig, field_docs

ON_OFF = ("on", "off")
"""The values a switch takes (`--deterministic` alone is on); every service reads both."""


@dataclass(frozen=True)
class ForwardedSettings:
    """Settings of one service that a command takes and passes on to every process of it."""

    config: type[ServiceConfig]
    """The service's config class: the settings' types, defaults and help."""
    service: str
    """The service's name, for the help (``gpu_worker``)."""
    names: tuple[str, ...]
    """The config's fields the command takes, each as ``--field-name``."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The command's own default where it is not the service's: always passed on."""
    default_words: Mapping[str, str] = field(default_factory=dict)
    """The help's words for a default the command decides later (from its other flags)."""
    choices: Mapping[str, Collection[str]] = field(default_factory=dict)
    """The values a setting may take, checked by the command before anything starts."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _owners(groups: Sequence[ForwardedSettings]) -> dict[str, list[ForwardedSettings]]:
    """Each setting name, in order, with the services that take it (``model``: several)."""
    owners: dict[str, list[ForwardedSettings]] = {}
    for group in groups:
        for name in group.names:
            owners.setdefault(name, []).append(group)
    return owners


def default_words(name: str, owners: Sequence[ForwardedSettings]) -> str:
    """The default of one setting as its help states it: the command's words or own default,
    else the service's value (a switch as on/off)."""
    first = owners[0]
    if name in first.default_words:
        return first.default_words[name]
    if name in first.defaults:
        return str(first.defaults[name])
    value = getattr(first.config, name)
    return ON_OFF[not value] if isinstance(value, bool) else str(value)


def _help(name: str, owners: list[ForwardedSettings]) -> str:
    services = " and ".join(f"each {o.service}" for o in owners)
    # argparse formats help with %: a docstring's percent sign is text.
    text = f"{field_docs(owners[0].config)[name]} [{services}; default {default_words(name, owners)}]"
    return text.replace("%", "%%")


def add_setting_options(
    parser: argparse._ActionsContainer,
    groups: Sequence[ForwardedSettings],
    placed: Mapping[str, argparse._ActionsContainer] | None = None,
) -> None:
    """Adds each setting of ``groups`` once, as ``--field-name``: a switch for a bool
    (``--deterministic``, or ``--prefix-cache on|off``), else a value of the field's type; in
    ``parser``, or in the argument group ``placed`` names for it. Unset, its value is the
    group's own default or None (the service's)."""
    for name, owners in _owners(groups).items():
        kind = get_type_hints(owners[0].config)[name]
        options: dict[str, Any] = {"dest": name, "default": owners[0].defaults.get(name)}
        if kind is bool:
            options.update(nargs="?", const="on", choices=ON_OFF, metavar="on|off")
        else:
            options["type"] = kind
            if choices := next((o.choices[name] for o in owners if name in o.choices), None):
                options["choices"] = sorted(choices)
        (placed or {}).get(name, parser).add_argument(flag(name), help=_help(name, owners), **options)


def setting_flags(args: argparse.Namespace, groups: Sequence[ForwardedSettings]) -> list[str]:
    """The settings of ``groups`` that have a value in ``args``, as flags (each once): what a
    service of one group is passed, or the command itself (`up --detach` runs `up` again)."""
    flags: list[str] = []
    for name in _owners(groups):
        if (value := getattr(args, name)) is not None:
            flags += [flag(name), str(value)]
    return flags
