"""Which adapters are paged into the unified pool, who is using them, and which goes first.

One source of truth with explicit reference counts (the lesson of SGLang's LoRARegistry): a
running request holds a reference to its adapter; only adapters with no reference and no pin
may be evicted, in the order of an eviction policy (least recently used first by default,
S-LoRA §5.1; ``--eviction-policy``), when the pool needs pages. A pinned adapter, once paged in,
stays: its pages are not the pool's to give back, to adapters or to KV.

Residency is accounting: it chooses the pages and the row offsets. Writing the rows there is the
caller's (``write_rows``): by default into this pool's buffer; the engine passes its executor's,
which may write a shard of them into the pool of every rank of a tensor-parallel group.

A load costs the engine thread a walk over the adapter's modules, not its rows: the page bound
and the placement are computed per module as runs of rows back to back (``_place``), and the
per-row offsets (host tuples and the device tensors the kernels read) are built from those runs
by whoever first asks for ``ResidentAdapter.modules``: the copier's thread, with the copy
(``ResidentAdapter.materialize``), so a page-in beside a running batch does not spend a step's
time on it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from services.gpu_worker.kernels.lora_segments import AdapterRows, runs_of
from services.gpu_worker.lora.host_adapter import HostAdapter, ModuleKey
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import EvictionPolicy, LRUEviction, set_pins


@dataclass(frozen=True)
class PlacedModule:
    """Where one projection's LoRA rows sit in the pool, and its scale."""

    rows: AdapterRows
    scale: float
    a_offsets: tuple[int, ...]
    """``rows.a_offsets`` on the host: where an executor writes the A rows (no device sync)."""
    b_offsets: tuple[int, ...]
    """``rows.b_offsets`` on the host."""
    a_runs: tuple[tuple[int, int], ...] | None = None
    """``(first offset, rows)`` of the A rows lying back to back (None: found from ``a_offsets``)."""
    b_runs: tuple[tuple[int, int], ...] | None = None
    """The same for the Bᵀ rows."""


NOT_TARGETED = object()
"""What :meth:`ResidentAdapter.signature` answers for a projection the adapter adapts in no layer."""

ModuleRuns = tuple[ModuleKey, float, int, tuple[tuple[int, int], ...], int, tuple[tuple[int, int], ...]]
"""One module's placement as runs: (key, scale, A width, A runs, Bᵀ width, Bᵀ runs)."""


class ResidentAdapter:
    """An adapter's load in the pool: its pages and where each module's rows are.

    ``modules`` may be given as they are, or as ``runs`` (what :meth:`AdapterResidency.load`
    computes on the engine thread): then the per-row offsets are built on first use, once
    (:meth:`materialize`; the copier does it with the copy).
    """

    def __init__(
        self,
        adapter_id: str,
        pages: list[int],
        modules: dict[ModuleKey, PlacedModule] | None = None,
        nbytes: int = 0,
        placement: int = 0,
        refcount: int = 0,
        *,
        runs: list[ModuleRuns] | None = None,
        device: torch.device | None = None,
        row_chunks: tuple[tuple[int, int], ...] | None = None,
    ):
        if (modules is None) == (runs is None):
            raise ValueError("ResidentAdapter takes its modules or their runs, one of the two")
        self.adapter_id = adapter_id
        self.pages = pages
        self.nbytes = nbytes
        self.placement = placement
        """Unique to this load: an adapter paged out and in again gets a new one, so (adapter,
        placement) names where its rows are without comparing page lists."""
        self.refcount = refcount
        """Running requests using it; evictable only at 0."""
        self.row_chunks = row_chunks
        """``(pool offset, elements)`` of each region's share of the rows, in the adapter's module
        order, A then Bᵀ (its ``HostAdapter.rows`` order): the chunks are consecutive slices of
        those rows, so one copy each writes them. None: placed otherwise (given as ``modules``)."""
        self._modules = modules
        self._runs = runs
        self._device = device
        self._lock = threading.Lock()
        self._signatures: dict[str, object] = {}
        self._layer_offsets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def modules(self) -> dict[ModuleKey, PlacedModule]:
        """Where each projection's rows are (built from the runs on first use)."""
        modules = self._modules
        if modules is None:
            with self._lock:
                if self._modules is None:
                    self._modules = _materialize(self._runs, self._device)
                    self._runs = None
                modules = self._modules
        return modules

    def materialize(self) -> None:
        """Build the per-row offsets now (the copier's thread, not the engine's)."""
        self.modules  # noqa: B018

    def signature(self, module: str, num_layers: int) -> tuple[int, float] | object | None:
        """``(rank, scale)`` of projection ``module`` when all ``num_layers`` layers have it with
        that rank and scale (the usual adapter), :data:`NOT_TARGETED` when none has it, None when
        they differ (``rank_pattern``, ``alpha_pattern``, ``layers_to_transform``). Computed once:
        the step builder asks at every change of the batch."""
        if module not in self._signatures:
            modules = self.modules
            found = set()
            for layer in range(num_layers):
                placed = modules.get((layer, module))
                found.add(NOT_TARGETED if placed is None else (placed.rows.rank, placed.scale))
            self._signatures[module] = found.pop() if len(found) == 1 else None
        return self._signatures[module]

    def layer_offsets(self, module: str, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The A and Bᵀ row offsets of projection ``module`` in every layer, ``[num_layers, rank]``
        each, for a projection whose :meth:`signature` is one rank in all layers: a step gathers
        a projection's offsets for all layers in one ``cat`` of these. Computed once."""
        cached = self._layer_offsets.get(module)
        if cached is None:
            placed = [self.modules[(layer, module)].rows for layer in range(num_layers)]
            cached = self._layer_offsets[module] = (
                torch.stack([rows.a_offsets for rows in placed]),
                torch.stack([rows.b_offsets for rows in placed]),
            )
        return cached

    def __repr__(self) -> str:
        return (
            f"ResidentAdapter({self.adapter_id!r}, pages={len(self.pages)}, placement={self.placement}, "
            f"refcount={self.refcount})"
        )


def _materialize(runs: list[ModuleRuns], device: torch.device | None) -> dict[ModuleKey, PlacedModule]:
    """Per-row offsets of every module from its runs, in one vectorised pass (one host-to-device
    copy; each module's rows are views of it, split off in one call)."""
    starts: list[int] = []
    counts: list[int] = []
    widths: list[int] = []
    factor_rows: list[int] = []  # rows of each module's A, then of its Bᵀ, module after module
    for _, _, a_width, a_runs, b_width, b_runs in runs:
        for width, factor_runs in ((a_width, a_runs), (b_width, b_runs)):
            for start, count in factor_runs:
                starts.append(start)
                counts.append(count)
                widths.append(width)
            factor_rows.append(sum(count for _, count in factor_runs))
    if not starts:
        return {}
    # Row i of a run starting at row f of all rows lies at start + (i - f) * width: each run's
    # start - f * width and width repeated over its rows, no gather by row.
    counts_t = torch.tensor(counts, dtype=torch.int64)
    widths_t = torch.tensor(widths, dtype=torch.int64)
    first_row = torch.cumsum(counts_t, 0) - counts_t
    total = sum(counts)
    offsets = torch.repeat_interleave(
        torch.tensor(starts, dtype=torch.int64) - first_row * widths_t, counts_t, output_size=total
    ) + torch.arange(total, dtype=torch.int64) * torch.repeat_interleave(
        widths_t, counts_t, output_size=total
    )
    host = offsets.tolist()
    on_device = offsets if device is None or device.type == "cpu" else offsets.to(device)
    views = on_device.split(factor_rows)
    modules = {}
    row = 0
    for index, (key, scale, a_width, a_runs, b_width, b_runs) in enumerate(runs):
        a_end = row + factor_rows[2 * index]
        b_end = a_end + factor_rows[2 * index + 1]
        rows = AdapterRows.placed(
            views[2 * index], views[2 * index + 1], {("a", a_width): a_runs, ("b", b_width): b_runs}
        )
        modules[key] = PlacedModule(
            rows=rows,
            scale=scale,
            a_offsets=tuple(host[row:a_end]),
            b_offsets=tuple(host[a_end:b_end]),
            a_runs=a_runs,
            b_runs=b_runs,
        )
        row = b_end
    return modules


def _pages_upper_bound(adapter: HostAdapter, page_elems: int) -> int:
    """Pages the adapter needs if no two of its pages are adjacent (no row may cross a page).

    Per module and factor, not per row: fill the current page, then whole pages of
    ``page_elems // width`` rows, then a last part-filled one.
    """
    pages, offset = 1, 0
    for factors in adapter.modules.values():
        count = factors.a.shape[0]
        for width in (factors.a.shape[1], factors.b_t.shape[1]):
            if width > page_elems:
                raise ValueError(f"a LoRA row of {width} elements does not fit a page of {page_elems}")
            fit = min(count, (page_elems - offset) // width)
            left = count - fit
            if not left:
                offset += fit * width
                continue
            per_page = page_elems // width
            full, rest = divmod(left, per_page)
            pages += full + (rest > 0)
            offset = (rest or per_page) * width
    return pages


def _regions(pages: list[int], page_elems: int) -> list[tuple[int, int]]:
    """Runs of physically adjacent pages as ``(first element, elements)``: rows may cross page
    boundaries inside a run, which keeps each projection's rows back to back (one view)."""
    ordered = sorted(pages)  # the allocator hands pages out in order: linear
    if ordered[-1] - ordered[0] == len(ordered) - 1:  # distinct pages: one run
        return [(ordered[0] * page_elems, len(ordered) * page_elems)]
    starts = [0, *(i for i in range(1, len(ordered)) if ordered[i] != ordered[i - 1] + 1), len(ordered)]
    return [(ordered[i] * page_elems, (j - i) * page_elems) for i, j in itertools.pairwise(starts)]


RowWriter = Callable[[HostAdapter, ResidentAdapter], None]
"""Writes an adapter's rows at the offsets of its placement."""


def write_rows(buffer: torch.Tensor, adapter: HostAdapter, resident: ResidentAdapter) -> None:
    """Copy ``adapter``'s A and B rows into ``buffer`` (a pool's) where ``resident`` placed them:
    one copy per region of adjacent pages the placement spans, usually one (a copy per run of rows
    costs ~3 µs of Python each, 420 of them for an adapter on SmolLM2's seven projections, and
    each is a transfer of its own to a GPU)."""
    if resident.row_chunks is not None and adapter.rows is not None:
        source = 0
        for start, length in resident.row_chunks:
            buffer[start : start + length].copy_(adapter.rows[source : source + length], non_blocking=True)
            source += length
        return
    for key, factors in adapter.modules.items():
        placed = resident.modules[key]
        _copy_rows(buffer, factors.a, placed.a_runs or runs_of(placed.a_offsets, factors.a.shape[1]))
        _copy_rows(buffer, factors.b_t, placed.b_runs or runs_of(placed.b_offsets, factors.b_t.shape[1]))


def _copy_rows(buffer: torch.Tensor, matrix: torch.Tensor, runs) -> None:
    # Rows placed back to back are copied in one go.
    width = matrix.shape[1]
    row = 0
    for offset, count in runs:
        buffer[offset : offset + count * width].copy_(matrix[row : row + count].reshape(-1))
        row += count


def _place(
    adapter: HostAdapter, regions: list[tuple[int, int]], page_elems: int
) -> tuple[list[ModuleRuns], list[int], tuple[tuple[int, int], ...]]:
    """Each module's rows as runs, A then Bᵀ, back to back in ``regions`` in order (a row that
    does not fit the rest of a region starts the next one); and the pages the rows touch, in
    order. The same offsets as placing row by row, at a cost per module, not per row. Third: the
    ``(first element, elements)`` each region holds, from its start: in module order, A then Bᵀ,
    the rows are those chunks one after the other."""
    used_by_region: list[int] = []
    index = 0
    start, length = regions[0]
    used = 0
    placed: list[ModuleRuns] = []
    for key, factors in adapter.modules.items():
        count, a_width = factors.a.shape
        b_width = factors.b_t.shape[1]
        if used + count * (a_width + b_width) <= length:  # the module fits the region's rest
            first = start + used
            a_runs, b_runs = ((first, count),), ((first + count * a_width, count),)
            placed.append((key, factors.scale, a_width, a_runs, b_width, b_runs))
            used += count * (a_width + b_width)
            continue
        factor_runs = []
        for width in (a_width, b_width):
            runs = []
            left = count
            while left:
                fit = min(left, (length - used) // width)
                if fit:
                    runs.append((start + used, fit))
                    used += fit * width
                    left -= fit
                if left:
                    used_by_region.append(used)
                    index += 1
                    start, length = regions[index]
                    used = 0
            factor_runs.append((width, tuple(runs)))
        (a_width, a_runs), (b_width, b_runs) = factor_runs
        placed.append((key, factors.scale, a_width, a_runs, b_width, b_runs))
    used_by_region.append(used)
    touched: list[int] = []
    chunks = []
    for (region_start, _), region_used in zip(regions, used_by_region):
        if region_used:  # rows lie back to back from the region's start
            first = region_start // page_elems
            touched.extend(range(first, first + -(-region_used // page_elems)))
            chunks.append((region_start, region_used))
    return placed, touched, tuple(chunks)


class AdapterResidency:
    """Adapters resident in the pool, by id, in their eviction policy's order."""

    def __init__(
        self,
        pool: UnifiedPool,
        write: RowWriter | None = None,
        on_evict: Callable[[str], None] | None = None,
        eviction: EvictionPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        """``write``: what writes a loaded adapter's rows (default: into ``pool``'s buffer);
        ``on_evict``: told each adapter evicted; ``eviction``: the order idle adapters go in
        (default least recently used first); ``prefix_cache``: cached KV blocks, which give their
        pages back first when the pool needs room."""
        self.pool = pool
        self.prefix_cache = prefix_cache
        self._write = write or (lambda adapter, resident: write_rows(pool.buffer, adapter, resident))
        self._on_evict = on_evict
        self._eviction = eviction or LRUEviction()
        self._resident: dict[str, ResidentAdapter] = {}
        self._placements = itertools.count()
        self._bounds: dict[str, tuple[weakref.ref, int]] = {}
        """Page bound of each adapter object last asked about (``pages_needed`` runs where it
        is added, off the engine thread; ``load`` finds it here)."""

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def ids(self) -> list[str]:
        """Resident adapters, the first to be evicted first."""
        return self._eviction.order()

    def get(self, adapter_id: str) -> ResidentAdapter | None:
        return self._resident.get(adapter_id)

    def set_pinned(self, adapter_ids: Iterable[str]) -> None:
        """Make ``adapter_ids`` the adapters never evicted (resident now or once paged in)."""
        set_pins(self._eviction, adapter_ids)

    def is_pinned(self, adapter_id: str) -> bool:
        return adapter_id in self._eviction.pinned()

    def pages_needed(self, adapter: HostAdapter) -> int:
        """Pages to have free before loading ``adapter`` (an upper bound; extras are returned).
        Any thread: the bound is kept for ``load``."""
        cached = self._bounds.get(adapter.adapter_id)
        if cached is not None and cached[0]() is adapter:
            return cached[1]
        bound = _pages_upper_bound(adapter, self.pool.page_elems)
        self._bounds[adapter.adapter_id] = (weakref.ref(adapter), bound)
        return bound

    def load(self, adapter: HostAdapter) -> ResidentAdapter:
        """Page ``adapter`` in (a no-op when resident), evicting idle adapters to make room.

        Raises ``PoolExhausted`` when even evicting every idle adapter is not enough.
        """
        resident = self._resident.get(adapter.adapter_id)
        if resident is not None:
            self._eviction.touch(adapter.adapter_id)
            return resident
        page_elems = self.pool.page_elems
        needed = self.pages_needed(adapter)
        self.make_room(needed)
        pages = self.pool.allocate(needed, PageUse.ADAPTER)
        runs, touched, row_chunks = _place(adapter, _regions(pages, page_elems), page_elems)
        if len(touched) < len(pages):
            kept = set(touched)
            self.pool.free([p for p in pages if p not in kept])  # the upper bound's unused pages
        resident = ResidentAdapter(
            adapter.adapter_id,
            touched,
            nbytes=adapter.numel * self.pool.buffer.element_size(),  # in the pool's dtype
            placement=next(self._placements),
            runs=runs,
            device=self.pool.device,
            row_chunks=row_chunks,
        )
        self._write(adapter, resident)
        self._resident[adapter.adapter_id] = resident
        self._eviction.touch(adapter.adapter_id)
        return resident

    def acquire(self, adapter_id: str) -> ResidentAdapter:
        resident = self._resident[adapter_id]
        resident.refcount += 1
        self._eviction.touch(adapter_id)
        return resident

    def release(self, adapter_id: str) -> None:
        resident = self._resident[adapter_id]
        if resident.refcount <= 0:
            raise RuntimeError(f"adapter {adapter_id} released more often than acquired")
        resident.refcount -= 1

    def _evictable(self) -> list[str]:
        """Resident adapters no request uses and no pin keeps."""
        pinned = self._eviction.pinned()
        return [a for a, r in self._resident.items() if r.refcount == 0 and a not in pinned]

    def idle_pages(self) -> int:
        """Pages eviction can give back now: those of adapters no request uses and no pin keeps."""
        return sum(len(self._resident[a].pages) for a in self._evictable())

    def make_room(self, pages: int, use: PageUse = PageUse.ADAPTER) -> None:
        """Evict unused cached prefix blocks, then idle unpinned adapters, each in its eviction
        order, until ``pages`` are free for ``use`` (raises ``PoolExhausted``, evicting nothing,
        when even evicting all of them is not enough).

        In a split pool evicting adapters frees nothing for KV, and cached KV blocks nothing for
        adapters.
        """
        allocator = self.pool.allocator
        if allocator.free_pages_for(use) >= pages:
            return
        # Unused cached prefix blocks go before idle adapters: an adapter is needed before any
        # of its requests can start, a cached prefix only saves recomputing it. In a split pool
        # cached blocks (KV pages) make room only for KV, and adapters only for adapters.
        cache = self.prefix_cache if allocator.unified or use is PageUse.KV else None
        cached = cache.evictable_pages() if cache is not None else 0
        idle_pages = self.idle_pages() if allocator.unified or use is PageUse.ADAPTER else 0
        if allocator.free_pages_for(use) + cached + idle_pages < pages:
            raise PoolExhausted(pages, allocator.free_pages_for(use))
        if cache is not None:
            cache.make_room(pages, use)
        for adapter_id in self._eviction.victims(self._evictable()):
            if allocator.free_pages_for(use) >= pages:
                break
            self.evict(adapter_id)

    def evict(self, adapter_id: str) -> None:
        resident = self._resident[adapter_id]
        if resident.refcount:
            raise RuntimeError(f"adapter {adapter_id} is in use by {resident.refcount} requests")
        del self._resident[adapter_id]
        self._eviction.remove(adapter_id)
        self.pool.free(resident.pages)
        if self._on_evict is not None:
            self._on_evict(adapter_id)
