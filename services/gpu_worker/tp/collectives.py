"""The two collectives a tensor-parallel step needs, with the bytes each moves counted.

Counting follows the ring cost model (bytes each rank sends): an all-reduce of ``n`` elements
moves ``2(N−1)/N · n · elem_size``, an all-gather producing ``n`` elements ``(N−1)/N · n ·
elem_size``. Counts are kept as exact fractions (``n`` need not be a multiple of ``N``), per
traffic tag (``"base"``, ``"lora"``) and kind (``"all_reduce"``, ``"all_gather"``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import torch


@dataclass
class TrafficCount:
    """What one (tag, kind) of collective moved."""

    calls: int = 0
    elements: int = 0
    """Elements reduced (all-reduce) or produced (all-gather), summed over calls."""
    bytes: Fraction = Fraction(0)
    """Bytes each rank sends under the ring model."""
    seconds: float = 0.0
    """Wall time spent inside the collective (for the bench; never for a verdict)."""


@dataclass
class TrafficCounter:
    counts: dict[tuple[str, str], TrafficCount] = field(default_factory=lambda: defaultdict(TrafficCount))

    def add(self, tag: str, kind: str, elements: int, nbytes: Fraction, seconds: float) -> None:
        c = self.counts[(tag, kind)]
        c.calls += 1
        c.elements += elements
        c.bytes += nbytes
        c.seconds += seconds

    def bytes(self, tag: str | None = None) -> Fraction:
        return sum((c.bytes for (t, _), c in self.counts.items() if tag in (None, t)), Fraction(0))

    def seconds(self, tag: str | None = None) -> float:
        return sum(c.seconds for (t, _), c in self.counts.items() if tag in (None, t))

    def snapshot(self) -> dict[str, dict]:
        """Plain data: ``{"tag/kind": {calls, elements, bytes (Fraction), seconds}}``."""
        return {
            f"{t}/{k}": {"calls": c.calls, "elements": c.elements, "bytes": c.bytes, "seconds": c.seconds}
            for (t, k), c in sorted(self.counts.items())
        }

    def reset(self) -> None:
        self.counts.clear()


class Collectives:
    """All-reduce (sum, in place) and all-gather along the last dim, over ``size`` ranks."""

    size: int = 1
    rank: int = 0

    def __init__(self) -> None:
        self.traffic = TrafficCounter()

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        start = time.perf_counter()
        self._all_reduce(tensor)
        n, size = tensor.numel(), self.size
        self.traffic.add(
            tag, "all_reduce", n, Fraction(2 * (size - 1) * n * tensor.element_size(), size),
            time.perf_counter() - start,
        )  # fmt: skip
        return tensor

    def all_gather(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        """Every rank's ``tensor`` (all the same shape), concatenated along the last dim in rank
        order."""
        start = time.perf_counter()
        out = self._all_gather(tensor)
        n, size = out.numel(), self.size
        self.traffic.add(
            tag, "all_gather", n, Fraction((size - 1) * n * tensor.element_size(), size),
            time.perf_counter() - start,
        )  # fmt: skip
        return out

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchDistributedCollectives(Collectives):
    """Over the default ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        super().__init__()
        self._dist = dist
        self._group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._dist.all_reduce(tensor, group=self._group)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        self._dist.all_gather(pieces, tensor, group=self._group)
        return torch.cat(pieces, dim=-1)
