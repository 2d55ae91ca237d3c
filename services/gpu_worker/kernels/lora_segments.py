"""The LoRA work of one (layer, projection) for one batch, as the kernels read it.

Adapter weights live as rank-rows scattered over the flat unified pool (DESIGN §5): row ``j`` of
A is ``pool[a_offsets[j] : a_offsets[j] + in_features]`` (= ``A[j, :]``) and row ``j`` of B^T is
``pool[b_offsets[j] : b_offsets[j] + out_features]`` (= ``B[:, j]``). A batch is a list of token
segments, each using one adapter (or none); :meth:`LoraSegments.build` turns that list into the
few flat tensors every backend reads. It runs for every layer x projection of every step, so it
does one ``torch.cat`` per offset kind and no Python work per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class AdapterRows:
    """Where one adapter's rank-rows for one (layer, projection) live in the pool.

    Compared and hashed by identity: the batch builder groups segments that pass the same object.
    """

    a_offsets: torch.Tensor
    """int64 [r]: element offset in the pool of row ``j`` of A (``in_features`` elements)."""
    b_offsets: torch.Tensor
    """int64 [r]: element offset in the pool of row ``j`` of B^T (``out_features`` elements)."""
    _runs: dict = field(default_factory=dict, init=False, repr=False)
    """Cache of :meth:`runs`."""

    def __post_init__(self) -> None:
        for name in ("a_offsets", "b_offsets"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(
                    f"AdapterRows.{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if self.a_offsets.numel() != self.b_offsets.numel():
            raise ValueError(
                f"AdapterRows: {self.a_offsets.numel()} A rows but {self.b_offsets.numel()} B rows"
            )
        if self.a_offsets.numel() == 0:
            raise ValueError("AdapterRows: rank 0; pass None for a segment without adapter")

    @classmethod
    def placed(
        cls, a_offsets: torch.Tensor, b_offsets: torch.Tensor, runs: dict[tuple[str, int], tuple]
    ) -> AdapterRows:
        """Rows a placement computed (views of one int64 offsets tensor, rank ≥ 1, their
        :meth:`runs` known): built without the checks, which cost more than the rest of an
        adapter's bookkeeping at page-in (one object per layer and projection, 210 on SmolLM2)."""
        rows = object.__new__(cls)
        object.__setattr__(rows, "a_offsets", a_offsets)
        object.__setattr__(rows, "b_offsets", b_offsets)
        object.__setattr__(rows, "_runs", runs)
        return rows

    @property
    def rank(self) -> int:
        """The LoRA rank r (number of rows of A and of B^T)."""
        return self.a_offsets.numel()

    def runs(self, factor: str, width: int) -> tuple[tuple[int, int], ...]:
        """``(first element offset, row count)`` of each run of rows of ``factor`` ("a" or "b")
        that lie back to back in the pool: each run is one strided view, no gather needed.
        Computed once per (factor, width) from the host copy of the offsets."""
        key = (factor, width)
        cached = self._runs.get(key)
        if cached is None:
            offsets = (self.a_offsets if factor == "a" else self.b_offsets).tolist()
            cached = self._runs[key] = runs_of(offsets, width)
        return cached


@dataclass(frozen=True)
class SegmentGroup:
    """Segments of one batch that share one adapter and scale (the CPU path does one matmul each)."""

    rows: AdapterRows
    """The adapter rows every segment of the group uses."""
    rank_start: int
    """The group's rows are ``a_offsets/b_offsets[rank_start:rank_end]``."""
    rank_end: int
    """End of the group's rows (exclusive); ``rank_end - rank_start`` is the rank."""
    scale: float
    """The scale every segment of the group uses."""
    token_ranges: tuple[tuple[int, int], ...]
    """Half-open token row ranges of the group in ``x``, ascending, adjacent ranges merged."""


@dataclass(frozen=True)
class LoraSegments:
    """The LoRA work of one (layer, projection) for one batch.

    Operation: ``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for each token ``t`` of segment
    ``s`` that has an adapter. Device tensors are for kernels; the host fields are for the CPU
    path and for launch shapes, so no backend has to copy anything back from the device.
    """

    seg_starts: torch.Tensor
    """int32 [S+1]: segment ``s`` is rows ``seg_starts[s]:seg_starts[s+1]`` of ``x`` (the tokens
    of one prefilling request, or the one token of a decoding request)."""
    rank_starts: torch.Tensor
    """int32 [S+1]: segment ``s`` uses ``a_offsets/b_offsets[rank_starts[s]:rank_starts[s+1]]``;
    an empty range (rank 0) means no adapter (base model only) for that segment."""
    a_offsets: torch.Tensor
    """int64 [sum of ranks]: pool offsets of A rows, segment after segment."""
    b_offsets: torch.Tensor
    """int64 [sum of ranks]: pool offsets of B^T rows, segment after segment."""
    scales: torch.Tensor
    """float32 [S]: LoRA scale per segment (``alpha / r``, or ``alpha / sqrt(r)`` with rslora)."""
    max_rank: int
    """Largest rank in the batch: sizes rank blocks and intermediates only, weights are never padded."""
    max_seg_len: int
    """Largest number of tokens in one segment (sizes the token-block grid)."""
    is_decode: bool
    """Every segment has exactly one token (MBGMV applies)."""
    in_features: int
    """Width of ``x`` and of an A row."""
    out_features: int
    """Width of ``out`` and of a B^T row."""
    seg_starts_host: tuple[int, ...]
    """``seg_starts`` as Python ints."""
    rank_starts_host: tuple[int, ...]
    """``rank_starts`` as Python ints; () for segments built on the device (:meth:`on_device`)."""
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    """Data a backend derives from this batch once and reuses while the engine reuses the batch
    (e.g. the native kernel's plan), keyed by the backend's own name."""
    group_first_segments: tuple[int, ...] = ()
    """The first segment of each group (``groups[g]`` uses ``adapters[group_first_segments[g]]``)."""
    shared: dict = field(default_factory=dict, compare=False, repr=False)
    """Like ``derived``, for data that depends only on the segments' structure (token counts,
    ranks, scales, grouping), not on where the rows are: shared by :meth:`with_rows` copies, i.e.
    by every layer of a projection in one step."""
    _groups: tuple[SegmentGroup, ...] | None = field(default=None, compare=False, repr=False)
    """:attr:`groups` once built (None: not yet)."""
    _regroup: tuple = field(default=(), compare=False, repr=False)
    """A :meth:`with_rows` copy's ``(template groups, adapters)``, which :attr:`groups` is built from."""

    @property
    def groups(self) -> tuple[SegmentGroup, ...]:
        """Segments with an adapter, grouped by (adapter, scale), in order of first appearance.

        A :meth:`with_rows` copy builds them on first use: the native kernel never asks (its plan
        is shared by the layers), and building a group object per group, layer and projection at
        every change of the batch cost a tenth of a 32-request decode step on a 2-core CPU."""
        groups = self._groups
        if groups is None:
            template, adapters = self._regroup
            groups = tuple(
                SegmentGroup(adapters[s], g.rank_start, g.rank_end, g.scale, g.token_ranges)
                for g, s in zip(template, self.group_first_segments, strict=True)
            )
            object.__setattr__(self, "_groups", groups)  # a cache: the frozen fields stay as they are
        return groups

    @property
    def num_segments(self) -> int:
        """Number of segments S."""
        return len(self.seg_starts_host) - 1

    @property
    def num_tokens(self) -> int:
        """Number of token rows T the segments cover."""
        return self.seg_starts_host[-1]

    @classmethod
    def build(
        cls,
        token_counts: list[int],
        adapters: list[AdapterRows | None],
        scales: list[float],
        in_features: int,
        out_features: int,
        device: torch.device | str,
    ) -> LoraSegments:
        """Describe a batch: segment ``s`` is the next ``token_counts[s]`` rows of ``x``, served with
        ``adapters[s]`` (None: no adapter) scaled by ``scales[s]``."""
        if not len(token_counts) == len(adapters) == len(scales):
            raise ValueError(
                f"LoraSegments.build: {len(token_counts)} token counts, {len(adapters)} adapters, "
                f"{len(scales)} scales"
            )
        if any(n < 0 for n in token_counts):
            raise ValueError(f"LoraSegments.build: negative token count in {token_counts}")
        ranks = [0 if a is None else a.rank for a in adapters]
        seg_starts = tuple(itertools.accumulate(token_counts, initial=0))
        rank_starts = tuple(itertools.accumulate(ranks, initial=0))
        groups, first_segments = _group(adapters, scales, seg_starts, rank_starts)
        present = [a for a in adapters if a is not None]
        if present:
            a_offsets = torch.cat([a.a_offsets for a in present]).to(device)
            b_offsets = torch.cat([a.b_offsets for a in present]).to(device)
        else:
            a_offsets = torch.empty(0, dtype=torch.int64, device=device)
            b_offsets = torch.empty(0, dtype=torch.int64, device=device)
        return cls(
            seg_starts=torch.tensor(seg_starts, dtype=torch.int32, device=device),
            rank_starts=torch.tensor(rank_starts, dtype=torch.int32, device=device),
            a_offsets=a_offsets,
            b_offsets=b_offsets,
            scales=torch.tensor(scales, dtype=torch.float32, device=device),
            max_rank=max(ranks, default=0),
            max_seg_len=max(token_counts, default=0),
            is_decode=all(n == 1 for n in token_counts),
            in_features=in_features,
            out_features=out_features,
            seg_starts_host=seg_starts,
            rank_starts_host=rank_starts,
            group_first_segments=first_segments,
            _groups=groups,
        )

    @classmethod
    def on_device(
        cls,
        seg_starts: torch.Tensor,
        seg_starts_host: tuple[int, ...],
        rank_starts: torch.Tensor,
        a_offsets: torch.Tensor,
        b_offsets: torch.Tensor,
        scales: torch.Tensor,
        max_rank: int,
        in_features: int,
        out_features: int,
    ) -> LoraSegments:
        """Decode segments (one token each) whose tables are device buffers filled on the device
        (``executor/lora_tables.py``): the rank starts are not known on the host, so the host
        fields hold only the token rows, ``max_rank`` is the tables' width and there are no
        groups; only the Triton kernels, which read the device tables, take them.
        ``seg_starts_host``: ``seg_starts`` as ints (``0 .. n``; shared by every layer)."""
        return cls(
            seg_starts=seg_starts,
            rank_starts=rank_starts,
            a_offsets=a_offsets,
            b_offsets=b_offsets,
            scales=scales,
            max_rank=max_rank,
            max_seg_len=1 if len(seg_starts_host) > 1 else 0,
            is_decode=True,
            in_features=in_features,
            out_features=out_features,
            seg_starts_host=seg_starts_host,
            rank_starts_host=(),
            _groups=(),
        )

    def with_rows(
        self,
        adapters: list[AdapterRows | None],
        offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> LoraSegments:
        """These segments served by ``adapters`` instead: another layer's rows of the same
        adapters, each of the same rank, in the same segments (one ``AdapterRows`` object per
        adapter, as for these). Shares everything but the row offsets, so a step builds the
        structure of a projection's work once, not once per layer. ``offsets``: the adapters'
        A and Bᵀ offsets already concatenated in segment order (the caller gathered every
        layer's at once); by default concatenated here."""
        if offsets is None:
            present = [a for a in adapters if a is not None]
            offsets = (
                torch.cat([a.a_offsets for a in present]).to(self.a_offsets.device),
                torch.cat([a.b_offsets for a in present]).to(self.b_offsets.device),
            )
        return LoraSegments(
            seg_starts=self.seg_starts,
            rank_starts=self.rank_starts,
            a_offsets=offsets[0],
            b_offsets=offsets[1],
            scales=self.scales,
            max_rank=self.max_rank,
            max_seg_len=self.max_seg_len,
            is_decode=self.is_decode,
            in_features=self.in_features,
            out_features=self.out_features,
            seg_starts_host=self.seg_starts_host,
            rank_starts_host=self.rank_starts_host,
            group_first_segments=self.group_first_segments,
            shared=self.shared,
            _regroup=(self.groups, tuple(adapters)),
        )


def _group(
    adapters: list[AdapterRows | None],
    scales: list[float],
    seg_starts: tuple[int, ...],
    rank_starts: tuple[int, ...],
) -> tuple[tuple[SegmentGroup, ...], tuple[int, ...]]:
    """Group segments by (adapter object, scale); empty segments contribute no token range.
    Returns the groups and the first segment of each."""
    first_segment: dict[tuple[AdapterRows, float], int] = {}
    ranges: dict[tuple[AdapterRows, float], list[tuple[int, int]]] = {}
    for s, adapter in enumerate(adapters):
        start, end = seg_starts[s], seg_starts[s + 1]
        if adapter is None or start == end:
            continue
        key = (adapter, float(scales[s]))
        first_segment.setdefault(key, s)
        spans = ranges.setdefault(key, [])
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    groups = tuple(
        SegmentGroup(
            rows=key[0],
            rank_start=rank_starts[s],
            rank_end=rank_starts[s + 1],
            scale=key[1],
            token_ranges=tuple(ranges[key]),
        )
        for key, s in first_segment.items()
    )
    return groups, tuple(first_segment.values())


def runs_of(offsets: Sequence[int], width: int) -> tuple[tuple[int, int], ...]:
    """``(first offset, rows)`` of each run of ``width``-element rows placed back to back."""
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and runs[-1][0] + runs[-1][1] * width == offset:
            runs[-1][1] += 1
        else:
            runs.append([offset, 1])
    return tuple((o, n) for o, n in runs)


def share_input(segments: Sequence[LoraSegments]) -> bool:
    """Whether these projections' segments cover the same token rows of one input (the same
    segment boundaries and input width), so one stacked launch can serve them all."""
    first = segments[0]
    return all(
        seg.seg_starts_host == first.seg_starts_host and seg.in_features == first.in_features
        for seg in segments[1:]
    )
