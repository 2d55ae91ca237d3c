"""Which version of an adapter a request names, and how a response names the version that served
it.

A reference is ``name`` or ``owner/name`` (:mod:`services.gateway.adapter_reference`), optionally
followed by a version: ``@N`` (the store's version number) or ``@sha256:<hex>`` (the sha256 of
its weights, whole or a prefix of at least :data:`MIN_DIGEST_PREFIX` hex digits that only one
content of the name starts with). Without one, the name's newest version when the request is
admitted. The gateway resolves the reference once, at admission, to one adapter id (a version's
id never changes and no other version shares it), which the request keeps for its whole life.

A response names its version as :func:`fingerprint` writes it: ``name@N sha256:<12 hex>``, whose
first word is a reference pinned to that version.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.gateway.adapter_reference import ResolvedAdapter, model_id
from services.runtime.errors import InvalidArgument, NotFound

MIN_DIGEST_PREFIX = 12
"""Fewest hex digits of a sha256 a reference may give."""
FINGERPRINT_DIGITS = 12
"""Hex digits of the sha256 a fingerprint shows."""

_VERSION_RE = re.compile(rf"[1-9][0-9]{{0,9}}|sha256:([0-9a-f]{{{MIN_DIGEST_PREFIX},64}})")


@dataclass(frozen=True, slots=True)
class VersionSelector:
    """Which version of a name a reference asks for."""

    number: int = 0
    """The store's version number; 0: not by number."""
    digest: str = ""
    """A sha256 of the weights (lowercase hex), whole or a prefix; "": not by content."""

    @property
    def latest(self) -> bool:
        """No version given: the name's newest."""
        return not self.number and not self.digest

    def matches(self, version: int, sha256: str) -> bool:
        if self.number:
            return version == self.number
        return sha256.startswith(self.digest)

    def __str__(self) -> str:
        return str(self.number) if self.number else f"sha256:{self.digest}" if self.digest else "latest"


LATEST = VersionSelector()


def split_version(reference: str) -> tuple[str, VersionSelector]:
    """``(name part, version)`` of ``reference``; InvalidArgument naming what is wrong with a
    version that is neither ``@N`` nor ``@sha256:<hex>``."""
    name, sep, version = reference.partition("@")
    if not sep:
        return reference, LATEST
    match = _VERSION_RE.fullmatch(version.lower())
    if not name or match is None:
        raise InvalidArgument(
            f"adapter {reference!r}: a version is '@N' (N from 1) or '@sha256:<hex>' "
            f"(at least {MIN_DIGEST_PREFIX} hex digits), after the name"
        )
    if match.group(1) is not None:
        return name, VersionSelector(digest=match.group(1))
    return name, VersionSelector(number=int(version))


class Versioned(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def sha256(self) -> str: ...


V = TypeVar("V", bound=Versioned)


def pick_version(versions: Iterable[V], selector: VersionSelector, reference: str) -> V | None:
    """The version of one name ``selector`` asks for among ``versions``: by number, or the newest
    whose content has the digest (a rollback republishes a content under a new number); None when
    there is none. A digest prefix that more than one content starts with is ambiguous:
    InvalidArgument naming ``reference``."""
    chosen = [v for v in versions if selector.matches(v.version, v.sha256)]
    if not chosen:
        return None
    if len({v.sha256 for v in chosen}) > 1:
        raise InvalidArgument(
            f"adapter {reference!r}: sha256 prefix {selector.digest!r} matches "
            f"{len({v.sha256 for v in chosen})} versions' contents; give more hex digits"
        )
    return max(chosen, key=lambda v: v.version)


def missing_version(owner: str, name: str, selector: VersionSelector) -> NotFound:
    return NotFound(f"adapter {name!r} of owner {owner!r} has no version {selector}")


def fingerprint(tenant: str, adapter: ResolvedAdapter) -> str:
    """How a response to ``tenant`` names the version of ``adapter`` that served it:
    ``reference@N sha256:<12 hex>``, where ``reference`` is the adapter as ``tenant`` names it
    (``name`` if its own, else ``owner/name``)."""
    return f"{model_id(tenant, adapter)}@{adapter.version} sha256:{adapter.sha256[:FINGERPRINT_DIGITS]}"
