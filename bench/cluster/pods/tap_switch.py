"""A learning Ethernet switch between TAP file descriptors that delays every frame.
``python -m bench.cluster.pods.tap_switch LATENCY_MS FD...`` (delayed_fabric.py starts it).
Each line ``FD_A FD_B MS`` on its stdin sets the delay between two ports, both ways (a
nemesis's latency fault between two nodes); ``MS`` below 0 puts the pair back to LATENCY_MS."""

from __future__ import annotations

import asyncio
import os
import sys

BROADCAST_BIT = 0x01


def main(argv: list[str]) -> None:
    delay_s = float(argv[0]) / 1000
    ports = [int(fd) for fd in argv[1:]]
    where: dict[bytes, int] = {}
    pair_delay_s: dict[tuple[int, int], float] = {}
    loop = asyncio.new_event_loop()

    def command() -> None:
        line = sys.stdin.readline()
        if not line:
            loop.remove_reader(sys.stdin.fileno())
            return
        a, b, ms = line.split()
        for pair in ((int(a), int(b)), (int(b), int(a))):
            if float(ms) < 0:
                pair_delay_s.pop(pair, None)
            else:
                pair_delay_s[pair] = float(ms) / 1000

    def send(fd: int, frame: bytes) -> None:
        try:
            os.write(fd, frame)
        except BlockingIOError:
            pass  # the device's queue is full: dropped, as a busy link drops

    def forward(port: int) -> None:
        try:
            frame = os.read(port, 65536)
        except BlockingIOError:
            return
        if len(frame) < 14:
            return
        where[frame[6:12]] = port
        destination = frame[0:6]
        out = [where[destination]] if not destination[0] & BROADCAST_BIT and destination in where else ports
        for fd in out:
            if fd != port:
                loop.call_later(pair_delay_s.get((port, fd), delay_s), send, fd, frame)

    for fd in ports:
        os.set_blocking(fd, False)
        loop.add_reader(fd, forward, fd)
    loop.add_reader(sys.stdin.fileno(), command)
    loop.run_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
