"""What part of the world a source URI names, for the import policy to compare.

A scope is a scheme and a path of segments: ``s3://bucket/a/b`` is ``("bucket", "a", "b")``,
``hf://org/repo@rev/sub`` is ``("org", "repo", "sub")`` (a revision is not a place), and
``file:///x/../y`` is the resolved ``/y`` (``..`` and symbolic links followed first, so no
spelling of a path escapes the directory a policy names). One scope covers another when it is
the same or a whole-segment prefix of it: ``s3://b/team`` covers ``s3://b/team/x`` but not
``s3://b/team-other``.

An ``s3://`` or ``hf://`` path is compared as the importer fetches it, never resolved: empty
segments (``a//b``) are dropped, as the importers drop them, and a ``.`` or ``..`` segment, or
one that percent-decodes to either or to a path separator (``%2e%2e``, ``%2F``), is refused
(InvalidArgument), since a client, proxy or mirror on the way might resolve what the scope
compared literally: ``s3://b/allowed/../secret`` is no source under ``s3://b/allowed/``.
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


def _segments(uri: str, path: str) -> tuple[str, ...]:
    """The non-empty ``/``-separated segments of ``path`` (of ``uri``); InvalidArgument naming
    the first one that is, or percent-decodes to, ``.``, ``..`` or a path separator."""
    segments = tuple(p for p in path.split("/") if p)
    for segment in segments:
        decoded = unquote(segment)
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            raise InvalidArgument(
                f"source {uri!r} has the path segment {segment!r}: '.', '..' and encoded "
                "separators are refused, not resolved"
            )
    return segments


def scheme_of(uri: str) -> str:
    """The URI's scheme, when it is one an import takes; InvalidArgument otherwise."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() not in IMPORT_SCHEMES:
        raise InvalidArgument(f"source {uri!r} is not an s3://, hf:// or file:// URI")
    return scheme.lower()


def split_hf(uri: str) -> tuple[str, str, str, tuple[str, ...]]:
    """``hf://org/repo[@revision][/subdir]`` → (org, repo, revision or "", subdir segments);
    repo may be "" (a whole organisation, as a policy may name it)."""
    parts = list(_segments(uri, uri[len("hf://") :]))
    if not parts:
        raise InvalidArgument(f"source {uri!r} names no Hub organisation: expected hf://org/repo")
    org, rest = parts[0], parts[1:]
    repo, _, revision = (rest[0] if rest else "").partition("@")
    _segments(uri, repo)  # "..@main": the repository is a segment of its own
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
        return SourceScope("s3", (*_segments(uri, bucket), *_segments(uri, prefix)))
    if scheme == "hf":
        org, repo, _, subdir = split_hf(uri)
        return SourceScope("hf", (org, repo, *subdir) if repo else (org,))
    return SourceScope("file", file_path(uri).parts[1:])
