"""An import scope is compared as the importer fetches it: no spelling of an ``s3://`` or
``hf://`` source with a dot segment gets past a policy that names its parent, and empty
segments do not change what a source is."""

from __future__ import annotations

import pytest

from services.adapter_store.import_policy import ImportPolicy
from services.adapter_store.importers.source_scope import scope_of
from services.runtime.errors import InvalidArgument, PermissionDenied

POLICY = ImportPolicy({"alice": ("s3://bucket/allowed/", "hf://org/repo")})


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/allowed/../secret",
        "s3://bucket/allowed/./../secret/x",
        "s3://bucket/allowed/%2e%2e/secret",
        "s3://bucket/allowed/%2E%2E/secret",
        "s3://bucket/allowed/..%2Fsecret",
        "s3://bucket/allowed/a%2F..%2F..%2Fsecret",
        "s3://../bucket/allowed/x",
        "hf://org/repo/../other-repo",
        "hf://org/repo/sub/%2e%2e/%2e%2e/other-repo",
        "hf://org/..@main/x",
        "hf://../org/repo",
    ],
)
def test_a_dot_segment_in_any_spelling_is_refused_not_matched(uri):
    with pytest.raises(InvalidArgument, match="path segment .* '.', '..' and encoded separators are refused"):
        POLICY.check("alice", uri)


def test_what_the_scope_names_is_allowed_and_empty_segments_collapse():
    assert POLICY.check("alice", "s3://bucket/allowed//a/").segments == ("bucket", "allowed", "a")
    assert POLICY.check("alice", "s3://bucket//allowed/a").segments == ("bucket", "allowed", "a")
    assert POLICY.check("alice", "hf://org/repo@v1//sub").segments == ("org", "repo", "sub")
    assert scope_of("s3://bucket/allowed...x").segments == ("bucket", "allowed...x")  # dots in a name
    with pytest.raises(PermissionDenied, match="may not import from s3://bucket/secret"):
        POLICY.check("alice", "s3://bucket/secret")


def test_a_policy_naming_a_dot_segment_stops_the_store_at_start():
    with pytest.raises(ValueError, match="import policy for tenant 'bob': source 's3://b/a/../c'"):
        ImportPolicy({"bob": ("s3://b/a/../c",)})
