"""A step's token events go out as one worker reply: its tokens in order, the end of the request
on the reply of its last token, an error end apart."""

from __future__ import annotations

from collections import deque

from services.gpu_worker.engine.request import FinishReason, Timings, TokenEvent
from services.gpu_worker.engine.sampling import TokenLogprobs
from services.gpu_worker.reply_coalescing import take_reply


def event(token: int | None, finish: FinishReason | None = None, logprob: float | None = None) -> TokenEvent:
    logprobs = None if logprob is None else TokenLogprobs(logprob, ((token or 0, logprob),))
    return TokenEvent("r", token, finish, Timings(), 0, logprobs=logprobs, cached_prompt_tokens=16)


def replies(events: list[TokenEvent]) -> list[tuple[list[int], FinishReason | None]]:
    pending, out = deque(events), []
    while pending:
        reply, last = take_reply(pending, "r")
        assert reply.request_id == "r"
        out.append((list(reply.token_ids), last.finish_reason))
    return out


def test_waiting_tokens_share_one_reply_and_the_end_rides_on_the_last():
    assert replies([event(5), event(6), event(7, FinishReason.LENGTH)]) == [([5, 6, 7], FinishReason.LENGTH)]
    assert replies([event(5), event(6)]) == [([5, 6], None)]


def test_nothing_joins_a_reply_past_its_end():
    assert replies([event(5, FinishReason.STOP), event(6)]) == [([5], FinishReason.STOP), ([6], None)]


def test_an_error_end_stays_apart_after_the_tokens_before_it():
    got = replies([event(5), event(6), event(None, FinishReason.ABORTED)])
    assert got == [([5, 6], None), ([], FinishReason.ABORTED)]
    got = replies([event(5), event(None, FinishReason.NO_KV)])
    assert got == [([5], None), ([], FinishReason.NO_KV)]


def test_an_end_without_a_token_is_a_reply_of_its_own():
    assert replies([event(5), event(None, FinishReason.CANCELLED)]) == [
        ([5], None),
        ([], FinishReason.CANCELLED),
    ]


def test_log_probabilities_follow_their_tokens():
    pending = deque([event(5, logprob=-0.5), event(6, logprob=-1.5)])
    reply, _ = take_reply(pending, "r")
    assert [lp.logprob for lp in reply.logprobs] == [-0.5, -1.5]
    assert [list(lp.top_token_ids) for lp in reply.logprobs] == [[5], [6]]
    assert reply.cached_prompt_tokens == 16
