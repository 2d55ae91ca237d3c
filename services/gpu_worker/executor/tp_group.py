"""A tensor-parallel group's lifecycle, from its driver (rank 0: the gpu_worker with ``--tp N``).

The driver spawns N−1 follower processes (``python -m services.gpu_worker.executor.follower``) that
meet it at a TCP store on a free loopback port (gloo on CPU; NCCL on CUDA, rank ``k`` on
``cuda:k``), then joins the process group itself and builds its :class:`TensorParallelExecutor`.

A rank that dies takes its group down: a monitor thread polls the followers and, when one exits
while the group is not stopping, calls ``on_death`` — by default it logs, flushes the logs and
exits the driver (``os._exit(1)``), so the supervisor (or Kubernetes) restarts the whole group and
its requests resume elsewhere through the usual resume path. Followers die with their driver
(``follower.die_with_parent``). CPU threads are split: each rank gets ``threads // N`` (≥ 1).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import torch

from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.executor.follower import GROUP_TIMEOUT, device_of
from services.gpu_worker.executor.tensor_parallel import TensorParallelExecutor, pool_pages
from services.gpu_worker.tp.sharding import TensorParallelLayout
from services.model_files.model_config import ModelConfig
from services.runtime.process.ports import free_port

log = logging.getLogger("loramesh.tp")

DeathHandler = Callable[[int, int], None]
"""Called with (rank, exit code) when a follower dies while the group runs."""


def exit_group(rank: int, code: int) -> None:
    """The default :data:`DeathHandler`: the whole group goes down with the driver's exit."""
    log.error("tensor-parallel rank %d died (exit code %s): the group goes down to be restarted", rank, code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def rank_threads(threads: int, size: int) -> int:
    """CPU threads of each rank when the group has ``threads`` (0: torch's default, split)."""
    return max(1, (threads or torch.get_num_threads()) // size)


class FollowerMonitor:
    """Polls the followers' processes; the first one that exits before :meth:`stopping` is
    reported to ``on_death`` (once)."""

    def __init__(self, procs: dict[int, subprocess.Popen], on_death: DeathHandler, poll_s: float = 0.2):
        self.procs = procs
        self.on_death = on_death
        self.poll_s = poll_s
        self._stop = threading.Event()
        self.died: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="tp-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and not self._stop.is_set():
                    self.died = (rank, code)
                    self._stop.set()
                    self.on_death(rank, code)
                    return

    def stopping(self) -> None:
        """The group is stopping: followers' exits are expected from now on."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class TensorParallelGroup:
    """The driver's view of its followers: spawn, monitor, reap."""

    def __init__(
        self,
        size: int,
        *,
        model_path: str,
        dtype: torch.dtype,
        device: str,
        num_pages: int,
        kv_block_tokens: int,
        threads: int,
        on_death: DeathHandler = exit_group,
    ):
        self.size = size
        self.device = torch.device(device)
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        dtype_name = str(dtype).removeprefix("torch.")
        for rank in range(1, size):
            command = [
                sys.executable, "-m", "services.gpu_worker.executor.follower", "--rank", str(rank), "--size", str(size),
                "--port", str(self.port), "--model", model_path, "--dtype", dtype_name, "--device", str(device),
                "--num-pages", str(num_pages), "--kv-block-tokens", str(kv_block_tokens), "--threads", str(threads),
            ]  # fmt: skip
            self.procs[rank] = subprocess.Popen(command)
        log.info("tensor-parallel group of %d: followers %s", size, {r: p.pid for r, p in self.procs.items()})
        self.monitor = FollowerMonitor(self.procs, on_death)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def join_process_group(self) -> None:
        """Join the group as rank 0 (blocks until every follower joined)."""
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{self.port}",
            rank=0,
            world_size=self.size,
            timeout=GROUP_TIMEOUT,
        )

    def stopping(self) -> None:
        self.monitor.stopping()

    def failed(self, error: BaseException) -> None:
        """A step's collective failed (a peer rank died mid-step): the group goes down as when
        the monitor sees a follower die."""
        log.error("tensor-parallel step failed: %s", error)
        self.monitor.stopping()
        self.monitor.on_death(-1, -1)

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers (told to stop), kill those that do not exit; leave the process
        group."""
        import torch.distributed as dist

        self.monitor.stopping()
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        """Kill every follower now (start failures; tests)."""
        self.monitor.stopping()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def start_group(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    engine_config: EngineConfig,
    size: int,
    *,
    model_path: str,
    dtype: torch.dtype,
    device: str = "cpu",
    threads: int = 0,
    on_death: DeathHandler = exit_group,
) -> TensorParallelExecutor:
    """Spawn the followers of a group of ``size`` and build rank 0's executor over ``config`` /
    ``weights`` (the full model, loaded from ``model_path``, as the followers load it). Refuses a
    degree that does not divide the model (the sharding module's ValueError) before spawning."""
    layout = TensorParallelLayout.for_config(config, size, 0)
    if engine_config.deterministic:
        raise ValueError("deterministic (batch-invariant) serving is not supported with --tp > 1")
    per_rank = rank_threads(threads, size)
    torch.set_num_threads(per_rank)
    group = TensorParallelGroup(
        size,
        model_path=model_path,
        dtype=dtype,
        device=device,
        num_pages=pool_pages(config, layout, engine_config, dtype),
        kv_block_tokens=engine_config.kv_block_tokens,
        threads=per_rank,
        on_death=on_death,
    )
    try:
        rank0 = device_of(device, 0)
        if rank0.type == "cuda":
            torch.cuda.set_device(rank0)
        group.join_process_group()
        return TensorParallelExecutor(config, weights, engine_config, size, dtype, rank0, group=group)
    except BaseException:
        group.kill()
        raise
