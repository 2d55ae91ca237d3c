"""What a ``FetchAdapter`` call may ask of the replica it reaches, beside its request.

A worker pulling a version the moment its row is created wants it from the replica that
committed it: that replica put the weights in its RAM tier before the commit, where any other
would read the blob back from disk and hash it again first. Nothing in the row says which
replica that was, so the worker asks each in turn to send it only from its RAM tier
(:data:`RAM_TIER_ONLY`); a replica without it there refuses ``FAILED_PRECONDITION`` at once
and the next is asked, the last without the hint.
"""

from __future__ import annotations

RAM_TIER_ONLY = ("loramesh-ram-tier-only", "1")
"""Call metadata: send the weights only if they are in this replica's RAM tier now, else refuse
``FAILED_PRECONDITION`` (a replica that does not know the hint sends them from anywhere)."""
