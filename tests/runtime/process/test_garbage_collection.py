"""Start-up objects frozen out of the collector's full passes: a full collection then visits
only what was made later (the worker's 73-130 ms pauses, bench/HISTORY.md), and the setting is
every service's, on by default."""

from __future__ import annotations

import gc

import pytest

from services.runtime.config import ServiceConfig, parse_config
from services.runtime.process.garbage_collection import freeze_startup_objects


@pytest.fixture
def unfrozen_afterwards():
    yield
    gc.unfreeze()


def test_frozen_objects_are_not_visited_by_a_full_collection(unfrozen_afterwards):
    held = [[i] for i in range(200_000)]  # containers the collector tracks, alive for good
    assert freeze_startup_objects() >= len(held)
    visited: list[int] = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            visited.append(len(gc.get_objects(generation=2)))

    gc.callbacks.append(count)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(count)
    assert visited and visited[0] < len(held) // 10
    assert held[-1] == [199_999]


def test_every_service_freezes_by_default_and_can_be_told_not_to():
    assert ServiceConfig().freeze_startup_objects is True
    assert parse_config(ServiceConfig, ["--freeze-startup-objects", "false"]).freeze_startup_objects is False
