"""Continue a broken generation stream on another gateway, right after what it delivered.

Every message of a stream carries its token ids and its text. The client keeps what it yielded
(:class:`StreamProgress`); when the stream breaks (its gateway died), it sends the same request
to the next gateway with a ``continuation``: those token ids and that text. The gateway goes on
right after them (docs/api.md, "Continuation"): a worker recomputes prompt + delivered tokens,
and the text resumes exactly where the delivered text ended. The caller sees one stream, with no
token or character twice and none missing, whatever the sampling; a greedy or seeded generation
gives what it would have given unbroken. The continuation names the adapter version that served
the first attempt (``name@N``), so a version published meanwhile does not serve the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramesh.types import ServedVersion, TextDelta
from mesh_api.v1 import gateway_pb2

ContinuableRequest = gateway_pb2.GenerateTextRequest | gateway_pb2.ChatRequest


@dataclass
class StreamProgress:
    """What one logical stream has delivered, across the attempts that produce it.

    Pass every message through :meth:`record`; :meth:`request` is what to send for the next
    attempt.
    """

    token_ids: list[int] = field(default_factory=list)
    """Every token id delivered, in order."""
    text: str = ""
    """Every piece of text delivered, joined."""
    finished: bool = False
    """The last message (with the finish reason) was delivered: nothing is left to continue."""
    served_by: ServedVersion | None = None
    """The adapter version serving the stream, from its first message (None: the base model)."""

    @property
    def delivered(self) -> bool:
        """Whether the caller has seen any token or text."""
        return bool(self.token_ids or self.text)

    def record(self, delta: TextDelta) -> None:
        """``delta`` reached the caller."""
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.finished = self.finished or delta.finish_reason is not None
        self.served_by = self.served_by or delta.served_by

    def request(self, first: ContinuableRequest) -> ContinuableRequest:
        """The request of the next attempt: ``first`` itself until something was delivered,
        then ``first`` continuing after it, on the adapter version that served it."""
        if not self.delivered:
            return first
        continued = type(first)()
        continued.CopyFrom(first)
        continued.continuation.token_ids[:] = self.token_ids
        continued.continuation.text = self.text
        if self.served_by is not None:
            continued.adapter = self.served_by.reference
        return continued
