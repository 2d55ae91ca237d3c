"""free_port: ports a later server can bind, out of the range outgoing connections are given."""

from __future__ import annotations

import random
import socket

from services.runtime.process import ports
from services.runtime.process.ports import LOWEST_PORT, ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low, _ = ephemeral_range()
    picked = [free_port() for _ in range(40)]
    assert len(set(picked)) == len(picked)
    assert all(LOWEST_PORT <= port < low for port in picked)
    for port in picked:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_a_server_already_holds_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        for seed in range(100):  # the first seed whose first pick this test can hold itself
            first = random.Random(seed).randrange(LOWEST_PORT, ephemeral_range()[0])
            try:
                held.bind(("127.0.0.1", first))
                break
            except OSError:
                continue
        held.listen()
        monkeypatch.setattr(ports, "_random", random.Random(seed))
        assert free_port() != first


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch, tmp_path):
    squeezed = tmp_path / "ip_local_port_range"
    squeezed.write_text(f"{LOWEST_PORT + 10}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", squeezed)
    assert ephemeral_range() == (LOWEST_PORT + 10, 60999)
    assert free_port() >= LOWEST_PORT + 10
