"""StreamProgress alone: what a stream delivered, and the request that continues after it."""

from __future__ import annotations

import dataclasses

from loramesh.stream_resume import StreamProgress
from loramesh.types import ServedVersion, TextDelta, Usage
from mesh_api.v1 import gateway_pb2, types_pb2


def delta(text: str, *tokens: int, finish: str | None = None) -> TextDelta:
    usage = Usage(3, 4, 1.0, 2.0, 0) if finish else None
    return TextDelta(text=text, token_ids=tokens, finish_reason=finish, usage=usage, request_id="r")


# One stream as the gateway sends it: token 2 is the first half of a two-token character, so its
# text arrives with token 3.
STREAM = [delta("He", 1), delta("", 2), delta("llé", 3), delta("!", 4, finish="stop")]
GENERATE = gateway_pb2.GenerateTextRequest(
    prompt="Say hello", adapter="mine", sampling=types_pb2.SamplingParams(max_tokens=8, temperature=0.7)
)


def progress_after(messages: list[TextDelta]) -> StreamProgress:
    progress = StreamProgress()
    for message in messages:
        progress.record(message)
    return progress


def test_nothing_delivered_sends_the_first_request_itself():
    progress = StreamProgress()
    assert not progress.delivered and progress.request(GENERATE) is GENERATE


def test_the_next_request_continues_after_every_token_and_all_the_text_delivered():
    progress = progress_after(STREAM[:2])
    continued = progress.request(GENERATE)
    # Token 2's text was held back by the gateway: the continuation says so by its extent.
    assert continued.continuation == gateway_pb2.Continuation(token_ids=[1, 2], text="He")
    continued.ClearField("continuation")
    assert continued == GENERATE and not GENERATE.HasField("continuation")
    assert progress.delivered and not progress.finished


def test_a_chat_request_continues_the_same_way():
    chat = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="Hi")])
    continued = progress_after(STREAM[:3]).request(chat)
    assert isinstance(continued, gateway_pb2.ChatRequest) and continued.messages == chat.messages
    assert continued.continuation == gateway_pb2.Continuation(token_ids=[1, 2, 3], text="Hellé")


def test_the_last_message_finishes_the_stream():
    progress = progress_after(STREAM)
    assert progress.finished and (progress.token_ids, progress.text) == ([1, 2, 3, 4], "Hellé!")


def test_a_continuation_names_the_adapter_version_that_served_the_stream():
    served = ServedVersion("mine", 3, "ab" * 32, "id-3", "mine@3 sha256:abababababab")
    first = dataclasses.replace(STREAM[0], served_by=served)
    continued = progress_after([first, *STREAM[1:3]]).request(GENERATE)
    # A version of "mine" published meanwhile does not serve the rest of this stream.
    assert continued.adapter == "mine@3"
    assert continued.continuation == gateway_pb2.Continuation(token_ids=[1, 2, 3], text="Hellé")
