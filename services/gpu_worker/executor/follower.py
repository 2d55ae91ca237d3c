"""A follower rank of a tensor-parallel group: ``python -m services.gpu_worker.executor.follower ...``.

Spawned by the driver (rank 0, the gpu_worker; ``tp.group``). It joins the group's process group,
loads the model as the worker does (``load_model``), builds its shard model and pool (as many
pages as every rank), and then runs the driver's broadcast operations in order — load an adapter,
evict one, run a step, stop — with the same ``StepBuilder`` over the same ``StepPlan`` as the
driver. It dies with its driver: ``PR_SET_PDEATHSIG`` where Linux offers it, and a thread that
exits when the parent process changes (a kill -9 of the driver leaves no orphan rank).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
from datetime import timedelta

import torch

log = logging.getLogger("loramesh.tp.follower")

PR_SET_PDEATHSIG = 1
GROUP_TIMEOUT = timedelta(days=365)
"""Collective timeout of a group: followers wait idle on the driver's next operation for as long
as the worker is idle; a dead rank is noticed by its peers' monitors, not by this timeout."""


def die_with_parent(poll_s: float = 0.5) -> None:
    """Exit when the parent process goes away (kill -9 included)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher below still works
    if os.getppid() != parent:  # died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def device_of(device: str, rank: int) -> torch.device:
    """``cuda`` -> ``cuda:rank`` (one GPU per rank); anything else as given."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" and d.index is None else d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the group's TCP store on 127.0.0.1")
    parser.add_argument("--model", default="", help="as the worker's --model (empty: the default)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-pages", type=int, required=True)
    parser.add_argument("--kv-block-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s"
    )

    import torch.distributed as dist

    from services.gpu_worker.executor.tensor_parallel import OpChannel, build_rank_state
    from services.gpu_worker.model.loading import load_model
    from services.gpu_worker.tp.sharding import TensorParallelLayout

    torch.set_num_threads(max(1, args.threads))
    device = device_of(args.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model or None)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.size,
        timeout=GROUP_TIMEOUT,
    )
    layout = TensorParallelLayout.for_config(loaded.config, args.size, args.rank)
    state = build_rank_state(
        loaded.config, loaded.weights, layout, args.num_pages, args.kv_block_tokens, dtype, device
    )
    del loaded
    channel = OpChannel(device)
    log.info("rank %d of %d ready on %s (%d pages)", args.rank, args.size, device, args.num_pages)
    with torch.inference_mode():
        while state.handle(channel.recv()):
            pass
    dist.destroy_process_group()
    log.info("rank %d stopped", args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
