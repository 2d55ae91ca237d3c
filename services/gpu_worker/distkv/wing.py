"""DistKV-LLM on one worker, built in one place: its rManager (requests' KV blocks, local and
borrowed), the lender other workers borrow from (metered, under the compute cap), and, with
``kv_overflow: borrow``, the borrower that asks other workers for blocks when the pool runs dry.

The engine builds one :class:`DistKv` and reaches DistKV through it and the names
``services.gpu_worker.distkv`` exports; nothing outside the package imports its modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.gpu_worker.distkv.block_lender import LendingConfig
from services.gpu_worker.distkv.block_recall import BlockRecalls
from services.gpu_worker.distkv.block_table import BlockTable
from services.gpu_worker.distkv.borrower import Borrower, CreditorDirectory, TransportFactory
from services.gpu_worker.distkv.distkv_meter import DistKvMeter, MeteredLender, metered_connect
from services.gpu_worker.distkv.lend_compute_cap import LendComputeCap
from services.gpu_worker.distkv.overflow import Borrowing, KvOverflow, Preemption
from services.gpu_worker.distkv.remote_block_allocator import CreditorRefused, CreditorUnavailable
from services.gpu_worker.distkv.rmanager import RManager
from services.gpu_worker.distkv.settings import AUTO_LEND_SHARE, DistKvSettings
from services.gpu_worker.memory.unified_pool import UnifiedPool

log = logging.getLogger("loramesh.engine")


class DistKv:
    """One worker's DistKV parts. ``supports_lending``: whether the executor can run requests
    whose KV is in rManager block tables; without it nothing is lent and the pool overflows by
    preemption, each fallback named in :attr:`fallbacks`."""

    def __init__(
        self,
        settings: DistKvSettings,
        pool: UnifiedPool,
        supports_lending: bool,
        busy: Callable[[], bool],
        creditors: CreditorDirectory | None = None,
        connect: TransportFactory | None = None,
    ):
        """``busy``: whether the worker has requests of its own (an idle worker lends all its
        compute). ``creditors`` and ``connect``: where to borrow and how to reach a creditor;
        required when ``settings.borrow``."""
        self.fallbacks: tuple[str, ...] = ()
        """DistKV settings this executor cannot honour, as ``setting->what runs instead``."""
        self.rm = RManager(
            settings.worker_id, pool, LendingConfig(self._lend_cap(settings, pool, supports_lending)),
            settings.deterministic,
        )  # fmt: skip
        self.meter = DistKvMeter()
        """This worker's lending traffic, as debtor and as creditor (heartbeat and metrics)."""
        self.lending = MeteredLender(
            self.rm.lender,
            pool.layout,
            self.meter,
            LendComputeCap(settings.lend_compute_share, settings.lend_compute_window_s, busy=busy),
        )
        """The lender as the lending RPCs reach it, from their own threads."""
        self.borrower: Borrower | None = None
        """Where blocks are borrowed from when the pool runs dry (None: the pool preempts)."""
        if settings.borrow and not supports_lending:
            log.warning("this executor cannot run borrowed KV: the pool overflows by preemption")
            self.fallbacks += ("borrow->preempt",)
        elif settings.borrow:
            if creditors is None or connect is None:
                raise ValueError("kv_overflow='borrow' needs a creditor directory and a transport factory")
            self.borrower = Borrower(self.rm, creditors, metered_connect(connect, self.meter))

    def kv_overflow(self, make_room: Callable[[int], None], room_blocks: Callable[[], int]) -> KvOverflow:
        """Where a request's KV goes when the pool cannot hold it: borrowed blocks with a
        borrower (``make_room(pages)`` and ``room_blocks()``: the pool's own room, used first),
        else preemption."""
        if self.borrower is None:
            return Preemption()
        return Borrowing(self.rm, self.borrower, make_room, room_blocks)

    def recalls(
        self, tables: Callable[[], list[BlockTable]], recompute: Callable[[BlockTable], None]
    ) -> BlockRecalls:
        """DGFM's recalls of this worker's blocks: ``tables`` are the running requests' block
        tables, ``recompute`` starts over a request whose blocks could not come back."""
        return BlockRecalls(self.rm, self.borrower, tables, recompute)

    def step_failed(
        self,
        failure: CreditorUnavailable | CreditorRefused,
        lost: Callable[[str], None],
        refused: Callable[[str], None],
    ) -> None:
        """A step met a creditor that could not serve it, and nothing of the step was kept (no
        token emitted, nothing counted as computed). Unreachable: ``lost(creditor)`` recomputes
        the requests that had blocks there, the others redo the step. Over its compute cap
        (DistKV-LLM's SLA threshold): ``refused(creditor)`` has those requests give their blocks
        back and recompute, and it is not asked again until its next heartbeat."""
        if isinstance(failure, CreditorUnavailable):
            log.warning("creditor %s is unreachable: %s", failure.creditor, failure.message)
            lost(failure.creditor)
            return
        log.info("creditor %s refused remote attention: %s", failure.creditor, failure.message)
        self.meter.add_remote_refusal()
        refused(failure.creditor)
        if self.borrower is not None:
            self.borrower.refused(failure.creditor)

    def _lend_cap(self, settings: DistKvSettings, pool: UnifiedPool, supports_lending: bool) -> int:
        wanted = settings.max_lent_blocks
        if wanted < -1:
            raise ValueError(f"max_lent_blocks must be -1 (auto), 0 or more, got {wanted}")
        if wanted == -1:  # the default: lend where the executor can, quietly not where it cannot
            layout = pool.layout
            wanted = int(AUTO_LEND_SHARE * layout.num_pages // layout.num_layers) if supports_lending else 0
        if wanted and not supports_lending:
            log.warning("this executor cannot lend KV blocks: the lending cap is 0")
            self.fallbacks += ("lend->off",)
            return 0
        return wanted
