"""The instance a call acts for: under mutual TLS the caller's own, never another's."""

from __future__ import annotations

import pytest

from services.runtime.errors import InvalidArgument, PermissionDenied
from services.runtime.security.acting_instance import acting_instance
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.tls import peer_identity_var


@pytest.fixture
def caller():
    def set_caller(identity):
        token = peer_identity_var.set(identity)
        tokens.append(token)

    tokens = []
    yield set_caller
    for token in reversed(tokens):
        peer_identity_var.reset(token)


def test_plaintext_takes_the_named_instance():
    assert acting_instance("gpu_worker-3") == "gpu_worker-3"
    with pytest.raises(InvalidArgument, match="debtor is empty"):
        acting_instance("")
    assert acting_instance("", required=False) == ""


def test_under_tls_the_caller_acts_only_as_itself(caller):
    caller(MeshIdentity("gpu_worker", "gpu_worker-0"))
    assert acting_instance("gpu_worker-0") == "gpu_worker-0"
    assert acting_instance("", required=False) == "gpu_worker-0"
    with pytest.raises(PermissionDenied, match="may not act for debtor 'gpu_worker-1'"):
        acting_instance("gpu_worker-1", required=False)


def test_a_certificate_without_an_instance_acts_for_no_one(caller):
    caller(MeshIdentity("gpu_worker"))
    with pytest.raises(PermissionDenied, match="names no instance"):
        acting_instance("gpu_worker-0")
