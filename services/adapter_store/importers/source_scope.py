"""What part of the world a source URI names, for the import policy to compare.

A scope is a scheme and a path of segments: ``s3://bucket/a/b`` is ``("bucket", "a", "b")``,
``hf://org/repo@rev/sub`` is ``("org", "repo", "sub")`` (a revision is not a place), and
``file:///x/../y`` is the resolved ``/y`` (``..`` and symbolic links followed first, so no
spelling of a path escapes the directory a policy names). One scope covers another when it is
the same or a whole-segment prefix of it: ``s3://b/team`` covers ``s3://b/team/x`` but not
``s3://b/team-other``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mesh_api.adapter_transfer import IMPORT_SCHEMES
from services.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class SourceScope:
    """A place adapters can be imported from, or the root of many."""

    scheme: str
    """``s3``, ``hf`` or ``file``."""
    segments: tuple[str, ...]
    """s3: bucket then key segments; hf: organisation, repository, subdirectory segments;
    file: the resolved absolute path's parts after ``/``."""

    def covers(self, other: SourceScope) -> bool:
        return self.scheme == other.scheme and other.segments[: len(self.segments)] == self.segments


def scheme_of(uri: str) -> str:
    """The URI's scheme, when it is one an import takes; InvalidArgument otherwise."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() not in IMPORT_SCHEMES:
        raise InvalidArgument(f"source {uri!r} is not an s3://, hf:// or file:// URI")
    return scheme.lower()


def split_hf(uri: str) -> tuple[str, str, str, tuple[str, ...]]:
    """``hf://org/repo[@revision][/subdir]`` → (org, repo, revision or "", subdir segments);
    repo may be "" (a whole organisation, as a policy may name it)."""
    parts = [p for p in uri[len("hf://") :].split("/") if p]
    if not parts:
        raise InvalidArgument(f"source {uri!r} names no Hub organisation: expected hf://org/repo")
    org, rest = parts[0], parts[1:]
    repo, _, revision = (rest[0] if rest else "").partition("@")
    return org, repo, revision, tuple(rest[1:])


def file_path(uri: str) -> Path:
    """The absolute path of ``file:///abs/path``, resolved (``..`` and links followed)."""
    split = urlsplit(uri)
    if split.netloc not in ("", "localhost") or not split.path.startswith("/"):
        raise InvalidArgument(f"source {uri!r} is not an absolute file:///path")
    return Path(unquote(split.path)).resolve()


def scope_of(uri: str) -> SourceScope:
    scheme = scheme_of(uri)
    if scheme == "s3":
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise InvalidArgument(f"source {uri!r} names no bucket: expected s3://bucket/prefix")
        return SourceScope("s3", (bucket, *(p for p in prefix.split("/") if p)))
    if scheme == "hf":
        org, repo, _, subdir = split_hf(uri)
        return SourceScope("hf", (org, repo, *subdir) if repo else (org,))
    return SourceScope("file", file_path(uri).parts[1:])
