"""Continue a broken generation stream on another gateway without repeating or losing a token.

The gateway API takes text, not token ids, so a stream cannot be resumed *after* the tokens it
delivered the way the gateway resumes on workers (prompt + tokens so far). Instead the SDK sends
the same request again and replays it: a deterministic generation (greedy, or sampled with a
seed) produces the same tokens and the same text, so the replayed prefix is checked against what
was delivered and skipped, and only what lies beyond it reaches the caller. A replay that differs
from what was delivered raises :class:`~loramesh.errors.StreamInterrupted` instead of yielding a
different continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramesh.errors import StreamInterrupted
from loramesh.types import TextDelta


def replayable(temperature: float | None, seed: int | None) -> bool:
    """Whether a generation gives the same tokens when run again: greedy, or seeded sampling."""
    return not temperature or seed is not None


@dataclass
class StreamReplay:
    """What one logical stream has delivered, across the attempts that produce it.

    Call :meth:`new_attempt` before each attempt and pass every message of it through
    :meth:`accept`, which returns what the caller has not seen yet (None: nothing new).
    """

    delivered_tokens: list[int] = field(default_factory=list)
    delivered_text: str = ""
    attempts: int = 0
    """Attempts started (1 + the replays)."""
    _tokens: list[int] = field(default_factory=list)
    _text: str = ""

    def new_attempt(self) -> None:
        """The request is being sent again (or for the first time)."""
        self.attempts += 1
        self._tokens, self._text = [], ""

    @property
    def delivered(self) -> bool:
        """Whether the caller has seen any token or text."""
        return bool(self.delivered_tokens or self.delivered_text)

    def accept(self, delta: TextDelta) -> TextDelta | None:
        """The part of ``delta`` beyond what was delivered, after checking that the attempt so
        far matches the delivered stream.

        Raises:
            StreamInterrupted: The replay produced a different token or text than was delivered.
        """
        start_tokens, start_text = len(self._tokens), len(self._text)
        self._tokens.extend(delta.token_ids)
        self._text += delta.text
        self._check(start_tokens, start_text, delta.request_id)
        new_tokens = tuple(self._tokens[len(self.delivered_tokens) :])
        new_text = self._text[len(self.delivered_text) :]
        if not (new_tokens or new_text or delta.finish_reason or delta.usage):
            return None
        self.delivered_tokens.extend(new_tokens)
        self.delivered_text += new_text
        return TextDelta(
            text=new_text,
            token_ids=new_tokens,
            finish_reason=delta.finish_reason,
            usage=delta.usage,
            request_id=delta.request_id,
        )

    def _check(self, start_tokens: int, start_text: int, request_id: str) -> None:
        for i in range(start_tokens, min(len(self._tokens), len(self.delivered_tokens))):
            if self._tokens[i] != self.delivered_tokens[i]:
                raise StreamInterrupted(
                    f"the stream broke after {len(self.delivered_tokens)} tokens and its replay "
                    f"(attempt {self.attempts}) gave token {self._tokens[i]} at position {i} where "
                    f"{self.delivered_tokens[i]} was delivered; not continued",
                    request_id=request_id or None,
                )
        end = min(len(self._text), len(self.delivered_text))
        if self._text[start_text:end] != self.delivered_text[start_text:end]:
            raise StreamInterrupted(
                f"the stream broke after {len(self.delivered_text)} characters and its replay "
                f"(attempt {self.attempts}) gave different text from character {start_text}; not continued",
                request_id=request_id or None,
            )
