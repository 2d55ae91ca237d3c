"""The group commit's wait for the items announced on their way (``GroupCommit.expect``): a
flush takes into its batch the items announced before it started waiting, up to ``linger_s``,
and never waits for later ones nor when nothing is on its way. Timed by an injected clock: a
test's flush waits until an item arrives or the clock says the bound has passed, never on the
machine's speed."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from support.cli import COMMAND_TIMEOUT_S

from services.adapter_store.group_commit import GroupCommit
from services.adapter_store.registrar import AdapterUpload
from services.runtime.errors import AlreadyExists, InvalidArgument

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class Batches:
    """An ``apply`` recording each batch it is given; every item committed."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def __call__(self, items):
        self.batches.append(list(items))
        return [None] * len(items)


class StoppedClock:
    """A clock that never advances (a flush waiting on it waits until its items arrive); sets
    ``waiting`` when read, i.e. once a flush has started waiting."""

    def __init__(self) -> None:
        self.waiting = threading.Event()

    def __call__(self) -> float:
        self.waiting.set()
        return 100.0


def submitted_in_thread(commits: GroupCommit[str], item: str) -> threading.Thread:
    thread = threading.Thread(target=commits.submit, args=(item,), daemon=True)
    thread.start()
    return thread


def waiting_flush(commits: GroupCommit[str], clock: StoppedClock, item: str) -> threading.Thread:
    """``item`` submitted from a thread of its own, once its flush waits for what is on its way."""
    thread = submitted_in_thread(commits, item)
    # A hang guard, not a timing claim: it only names a wait that never ends.
    assert clock.waiting.wait(COMMAND_TIMEOUT_S), "the flush never started waiting"
    return thread


def joined(thread: threading.Thread) -> None:
    thread.join(COMMAND_TIMEOUT_S)
    assert not thread.is_alive(), f"a submission still running after {COMMAND_TIMEOUT_S} s"


def test_a_flush_waits_for_an_item_announced_before_it_and_commits_both_in_one_batch():
    apply, clock = Batches(), StoppedClock()
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=clock)
    on_its_way = commits.expect()
    flushing = waiting_flush(commits, clock, "b")
    assert apply.batches == []
    commits.submit("a", on_its_way)
    joined(flushing)
    assert apply.batches == [["b", "a"]] and commits.batches == 1 and commits.on_their_way == 0


def test_a_flush_waits_no_longer_than_linger_s():
    apply = Batches()
    readings = iter([100.0, 100.0 + 0.01])  # the start of the wait, then its bound reached
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=lambda: next(readings))
    with commits.expect():  # never submitted while the flush waits
        commits.submit("b")
        assert apply.batches == [["b"]]
    assert commits.on_their_way == 0


def test_items_announced_after_a_flush_started_waiting_are_not_waited_for():
    apply, clock = Batches(), StoppedClock()
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=clock)
    first = commits.expect()
    flushing = waiting_flush(commits, clock, "b")
    with commits.expect() as later:
        commits.submit("a", first)
        joined(flushing)
        assert apply.batches == [["b", "a"]] and commits.on_their_way == 1
        commits.submit("c", later)
    assert apply.batches == [["b", "a"], ["c"]] and commits.on_their_way == 0


def test_a_withdrawn_announcement_ends_the_wait():
    apply, clock = Batches(), StoppedClock()
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=clock)
    with commits.expect():
        flushing = waiting_flush(commits, clock, "b")
    joined(flushing)  # refused before its commit, say: the flush goes on without it
    assert apply.batches == [["b"]]


def never_read() -> float:
    raise AssertionError("the flush waited")


def test_a_lone_caller_never_waits():
    apply = Batches()
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=never_read)
    with commits.expect() as own:
        commits.submit("a", own)
    assert apply.batches == [["a"]]


def test_without_linger_no_flush_waits():
    apply = Batches()
    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.0, clock=never_read)
    with commits.expect():  # on its way, but nothing waits for it
        commits.submit("b")
    assert apply.batches == [["b"]]


def test_a_failed_apply_still_counts_the_item_arrived():
    def apply(items):
        raise OSError("etcd went away")

    commits: GroupCommit[str] = GroupCommit(apply, linger_s=0.01, clock=never_read)
    with commits.expect() as own, pytest.raises(OSError, match="etcd went away"):
        commits.submit("a", own)
    assert commits.on_their_way == 0


def upload(files, name: str, weights: bytes | None = None) -> AdapterUpload:
    return AdapterUpload(name, "alice", 0, files[CONFIG], files[WEIGHTS] if weights is None else weights)


@pytest.mark.parametrize("publish", [False, True])
def test_a_registration_is_announced_only_until_it_commits_or_is_refused(
    open_repository, sample_files, publish
):
    repo = open_repository()
    registrar, commits = repo.registrar, repo.catalog._commits
    register: Callable[[AdapterUpload], object] = (
        registrar.register_version if publish else registrar.register
    )
    seen: list[int] = []
    commit = repo.catalog.commit

    def seeing_commit(*args, **kwargs):
        seen.append(commits.on_their_way)  # announced up to its submission
        return commit(*args, **kwargs)

    repo.catalog.commit = seeing_commit
    register(upload(sample_files, "a"))
    assert seen == [1] and commits.on_their_way == 0
    with pytest.raises(InvalidArgument):
        register(upload(sample_files, "b", weights=b"not safetensors"))
    if not publish:
        with pytest.raises(AlreadyExists):
            register(upload(sample_files, "a"))
    assert commits.on_their_way == 0 and repo.catalog.count() == 1
