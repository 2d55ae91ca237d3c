"""Writes paged-in adapters' rows into the pool on a thread of its own, so that the engine thread
only reserves their pages and the running batch never waits for a copy (S-LoRA §5.2 overlaps
adapter I/O with compute; Sglang#8162 is what serving looks like when it does not).

The engine thread chooses the pages and each module's runs of rows (``AdapterResidency``) and
hands the copy over; the per-row offsets (and their copy to the device) are built here, with the
copy (``ResidentAdapter.materialize``). No plan names those pages until the copy is done
(``AdapterPager`` holds the adapter back from its requests until then), so the copy and the steps never touch the same memory. On a GPU
the copy runs on a stream of its own and is finished on the device before it counts as done:
the step's kernels on the default stream do not queue behind it, nor it behind them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from services.gpu_worker.engine.side_threads import side_thread_pool
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import ResidentAdapter, RowWriter


class AdapterCopier:
    """One copy at a time, in the order asked (they share the host's and the link's bandwidth:
    running two at once would only finish both later)."""

    def __init__(self, write: RowWriter, device: torch.device, on_done: Callable[[], None] | None = None):
        """``write``: what writes an adapter's rows where the engine placed them (the executor's
        ``load_adapter``); ``on_done``: told after each copy ends, on the copier's thread (the
        engine's wake-up, so an idle engine settles it)."""
        self._write = write
        self._on_done = on_done
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = side_thread_pool(1, "loramesh-page-in", background=True)

    def start(self, adapter: HostAdapter, resident: ResidentAdapter) -> Future[float]:
        """Copy ``adapter``'s rows where ``resident`` placed them; the future gets the seconds from
        now to the rows being in the pool (queueing behind earlier copies included), or the
        copy's error."""
        copy = self._thread.submit(self._copy, adapter, resident, time.perf_counter())
        if self._on_done is not None:
            on_done = self._on_done
            copy.add_done_callback(lambda _: on_done())  # once done() is true, not before
        return copy

    def copy_here(self, adapter: HostAdapter, resident: ResidentAdapter) -> Future[float]:
        """The copy :meth:`start` would make, made now on the calling thread (the engine's, when no
        running batch would wait for it): the copier thread gives way to the engine's spinning
        team, so a copy the engine waits for would take several times as long there."""
        done: Future[float] = Future()
        try:
            done.set_result(self._copy(adapter, resident, time.perf_counter()))
        except Exception as error:  # noqa: BLE001 - settled as a failed copy, as on the copier thread
            done.set_exception(error)
        return done

    def _copy(self, adapter: HostAdapter, resident: ResidentAdapter, asked: float) -> float:
        if self._stream is None:
            resident.materialize()
            self._write(adapter, resident)
        else:
            with torch.cuda.stream(self._stream):
                resident.materialize()  # its offsets reach the device on this stream too
                self._write(adapter, resident)
            self._stream.synchronize()
        return time.perf_counter() - asked

    def close(self) -> None:
        """Finish the copies asked for, then stop the thread."""
        self._thread.shutdown(wait=True)
