"""StreamReplay alone: what a replayed stream yields after a break, and when it refuses."""

from __future__ import annotations

import pytest

from loramesh.errors import StreamInterrupted
from loramesh.stream_resume import StreamReplay, replayable
from loramesh.types import TextDelta, Usage


def delta(text: str, *tokens: int, finish: str | None = None) -> TextDelta:
    usage = Usage(3, 4, 1.0, 2.0, 0) if finish else None
    return TextDelta(text=text, token_ids=tokens, finish_reason=finish, usage=usage, request_id="r")


# One stream as the gateway sends it: token 2 is the first half of a two-token character, so its
# text arrives with token 3.
STREAM = [delta("He", 1), delta("", 2), delta("llé", 3), delta("!", 4, finish="stop")]


def run(replay: StreamReplay, messages: list[TextDelta]) -> list[TextDelta]:
    replay.new_attempt()
    return [out for m in messages if (out := replay.accept(m)) is not None]


def joined(deltas: list[TextDelta]) -> tuple[str, tuple[int, ...]]:
    return "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.token_ids)


@pytest.mark.parametrize("broken_after", range(len(STREAM)))
def test_a_replay_yields_exactly_what_the_break_cut_off(broken_after):
    replay = StreamReplay()
    before = run(replay, STREAM[:broken_after])
    after = run(replay, STREAM)
    assert joined(before + after) == ("Hellé!", (1, 2, 3, 4))
    assert after[-1].finish_reason == "stop" and after[-1].usage.completion_tokens == 4
    assert replay.attempts == 2


def test_tokens_delivered_ahead_of_their_text_are_not_repeated():
    replay = StreamReplay()
    assert joined(run(replay, STREAM[:2])) == ("He", (1, 2))
    after = run(replay, STREAM)
    # Token 2 is not yielded again; the text it completes comes with token 3.
    assert [(d.text, d.token_ids) for d in after] == [("llé", (3,)), ("!", (4,))]


def test_a_replay_with_another_token_is_refused():
    replay = StreamReplay()
    run(replay, STREAM[:3])
    with pytest.raises(StreamInterrupted, match="position 1"):
        run(replay, [STREAM[0], delta("", 9)])


def test_a_replay_with_other_text_is_refused():
    replay = StreamReplay()
    run(replay, STREAM[:3])
    with pytest.raises(StreamInterrupted, match="different text"):
        run(replay, [delta("Ha", 1)])


def test_the_first_attempt_passes_through_unchanged():
    replay = StreamReplay()
    assert run(replay, STREAM) == [m for m in STREAM if m.text or m.token_ids or m.finish_reason]
    assert not StreamReplay().delivered and replay.delivered


def test_only_greedy_or_seeded_generations_are_replayable():
    assert replayable(None, None) and replayable(0.0, None) and replayable(0.8, 3)
    assert not replayable(0.8, None)
