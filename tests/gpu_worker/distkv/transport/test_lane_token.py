"""Lane tokens (``services/gpu_worker/distkv/transport/lane_token.py``): a token names its debtor
until it expires on the creditor's clock, and only the creditor that signed it takes it."""

from __future__ import annotations

import base64

import pytest

from services.gpu_worker.distkv.transport.lane_token import HELLO_MAX_BYTES, LaneTokens, TokenRefused
from services.runtime.errors import InvalidArgument


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_names_its_debtor_until_it_expires():
    clock = Clock()
    tokens = LaneTokens(ttl_s=30, clock=clock)
    token = tokens.issue("gpu_worker-1").encode()
    assert tokens.issue("gpu_worker-1").encode() != token  # each issue is a new token
    clock.now += 30
    assert tokens.debtor(token) == "gpu_worker-1"  # still valid at its expiry
    clock.now += 2.5
    with pytest.raises(TokenRefused, match=r"^lane token of debtor 'gpu_worker-1' expired 2.5 s ago$"):
        tokens.debtor(token)


def test_a_token_another_creditor_signed_or_altered_is_refused():
    clock = Clock()
    ours, theirs = LaneTokens(clock=clock), LaneTokens(clock=clock)
    with pytest.raises(TokenRefused, match="signature does not match: not issued by this creditor"):
        ours.debtor(theirs.issue("gpu_worker-1").encode())
    raw = bytearray(base64.urlsafe_b64decode(ours.issue("gpu_worker-1")))
    raw[-33] ^= ord("1") ^ ord("2")  # the name's last byte: gpu_worker-2
    with pytest.raises(TokenRefused, match="signature does not match"):
        ours.debtor(base64.urlsafe_b64encode(raw))
    with pytest.raises(TokenRefused, match="too short to be one"):
        ours.debtor(b"0" * 32)
    with pytest.raises(TokenRefused, match="is not base64"):
        ours.debtor(b"abc")


def test_a_debtor_name_too_long_for_a_hello_gets_no_token():
    tokens = LaneTokens()
    assert len(tokens.issue("w" * 300)) <= HELLO_MAX_BYTES
    with pytest.raises(InvalidArgument, match=f"too long for a lane token .*at most {HELLO_MAX_BYTES} bytes"):
        tokens.issue("w" * 400)
    with pytest.raises(ValueError, match="TTL must be > 0"):
        LaneTokens(ttl_s=0)
