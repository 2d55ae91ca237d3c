"""The nemesis load's streams carry their deadline, and a stream whose deadline passes is recorded
as timed out (``info`` with DEADLINE_EXCEEDED, what it delivered kept), not as a failure; a
refusal is a ``fail`` naming its status. A fake client stands for the gateways (no mesh here)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.polling import poll_until

from bench.cluster.history import History, OpKind, Outcome
from bench.cluster.load import Load, LoadConfig
from loramesh.errors import DeadlineExceeded, LoraMeshError, ResourceExhausted
from loramesh.types import TextDelta


class FakeClient:
    """Each stream yields one token then raises the next of ``endings``; the load stops after."""

    def __init__(self, load: Load, endings: list[LoraMeshError]):
        self.load, self.endings = load, endings
        self.timeouts: list[float | None] = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def stream(self, prompt: str, *, timeout: float | None = None, **_):
        self.timeouts.append(timeout)
        yield TextDelta(text="x", token_ids=(7,), finish_reason=None, usage=None, request_id="r")
        ending = self.endings.pop(0)
        if not self.endings:
            self.load._stop.set()
        raise ending


def test_a_stream_past_its_deadline_is_a_timeout_and_a_refusal_a_failure(tmp_path: Path):
    config = LoadConfig(("127.0.0.1:1",), "key", ("ca", "cert", "key"), tmp_path, stream_deadline_s=42.0)
    history = History()
    load = Load(config, history)
    fake = FakeClient(load, [DeadlineExceeded("deadline passed"), ResourceExhausted("no worker lent")])
    load.client = lambda process: fake
    asyncio.run(load.streamer("borrow-0", borrowing=True))
    timed_out, refused = history.ops()
    assert fake.timeouts == [42.0, 42.0]
    assert (timed_out.kind, timed_out.outcome) == (OpKind.BORROW, Outcome.INFO)
    assert timed_out.error.startswith("DEADLINE_EXCEEDED") and timed_out.tokens == ((0, 7),)
    # Each token's arrival is on the history's clock, between the stream's invocation and end.
    assert len(timed_out.arrived_at) == 1
    assert timed_out.invoked_at <= timed_out.arrived_at[0] <= timed_out.completed_at
    assert refused.outcome == Outcome.FAIL and refused.error.startswith("RESOURCE_EXHAUSTED")


async def test_the_running_file_appears_once_the_first_operation_is_invoked(tmp_path: Path):
    config = LoadConfig(("127.0.0.1:1",), "key", ("ca", "cert", "key"), tmp_path, streamers=1, borrowers=0,
                        uploaders=0)  # fmt: skip
    history = History()
    load = Load(config, history)
    fake = FakeClient(load, [ResourceExhausted("no worker lent")] * 2)
    load.client = lambda process: fake
    running, stop = tmp_path / "running", tmp_path / "stop"

    async def stop_once_running() -> None:
        await poll_until(lambda: asyncio.sleep(0, running.exists()), bool, "the running file")
        assert len(history) > 0  # made after an operation was invoked, not before
        stop.touch()

    await asyncio.gather(load.run(stop, running), stop_once_running())
    assert [op.outcome for op in history.ops()] == [Outcome.FAIL, Outcome.FAIL]
